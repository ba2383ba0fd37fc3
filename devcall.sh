export PYTHONUNBUFFERED=1
(cd .variants/fp8-half2 && PYTHONPATH=$PWD timeout 100 python3 benchmarks/gemv_sweep.py --kinds fp8 --check fp8 --write > $OUT/sweep-fp8.log 2>&1; cp brisklm/kernels/gemv_tuned.json $OUT/fp8-tuned.json)
tail -9 $OUT/sweep-fp8.log
(cd .variants/fp8-half2 && PYTHONPATH=$PWD timeout 100 python3 -m brisklm bench --preset llama-3.1-8b --device cuda --compile --samples 3 --prefill "" --context "" --quantize fp8 > $OUT/bench-fp8-half2.log 2>&1)
grep -a "decode tokens/s\|fraction" $OUT/bench-fp8-half2.log
(cd .variants/main && PYTHONPATH=$PWD timeout 40 python3 benchmarks/gemv_sweep.py --kinds fp8 --retime --check '' > $OUT/retime-main.log 2>&1)
tail -7 $OUT/retime-main.log
