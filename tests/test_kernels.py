"""The Triton kernels (brisklm/kernels/) on the CPU. Their numbers come from
Triton's interpreter, the same kernel source the GPU compiles: against fp64
references at SmolLM2's shapes and at ragged ones, and inside whole quantized
models against their dequantized weights. Those checks are the programs of
tests/kernel_programs.py; the interpreter is chosen when triton is imported,
so every selected one runs in one child process with TRITON_INTERPRET=1.
Here as well: the inline PTX the interpreter cannot run, the tuned blocks,
the fusion pass. (benchmarks/gemv_sweep.py --check runs the GEMV comparison on
an H200 at the Llama-3.1-8B, Mixtral and SmolLM2 shapes.)"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "kernel_programs.py")


# About the seconds each program takes under the interpreter (a new one: 5), so that the two child
# processes below get about as much work each.
LONG = {"gemv_kernels_match_fp64_at_smollm2_and_ragged_shapes": 3,
        "int4_gemv_applies_the_norm_before_it": 9,
        "attention_kernel_over_a_few_new_tokens_matches_fp64": 9,
        "few_rows_matmul_matches_fp64_for_every_format": 6,
        "quantized_model_through_the_kernels_matches_its_dequantized_weights": 6,
        "decode_attention_kernel_matches_fp64": 4,
        "model_decodes_the_same_through_the_attention_kernel": 4,
        "custom_ops_fake_implementations_and_schemas": 4,
        "dp4a_kernels_represent_x_within_their_bound": 2,
        "attention_kernel_applies_the_q_k_norms_as_the_model_does": 1,
        "int4_words_matmul_matches_fp64": 8}


@pytest.fixture(scope="module")
def interpreted_results(request, tmp_path_factory) -> dict:
    """The programs of this module's selected tests that take `interpreted`,
    run under the interpreter in two child processes at once (the longest
    first, each to the process with less work so far): test id -> result."""
    items = [item for item in request.session.items
             if item.module is request.module and "interpreted" in item.fixturenames]
    calls = [[item.originalname.removeprefix("test_"), item.callspec.params if hasattr(item, "callspec") else {}]
             for item in items]
    shares, work = ([], []), [0, 0]
    for i in sorted(range(len(calls)), key=lambda i: -LONG.get(calls[i][0], 5)):
        lighter = work.index(min(work))
        shares[lighter].append(i)
        work[lighter] += LONG.get(calls[i][0], 5)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")  # (one core each)
    folder = tmp_path_factory.mktemp("kernels")
    children = [(share, folder / f"results{n}.json", subprocess.Popen(
        [sys.executable, PROGRAMS, str(folder / f"results{n}.json"), json.dumps([calls[i] for i in share])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for n, share in enumerate(shares) if share]
    results = {}
    for share, out, child in children:
        _, err = child.communicate(timeout=1800)
        if child.returncode != 0:  # (each of its programs' tests fails with the child's own error)
            results.update({items[i].nodeid: {"error": err[-3000:]} for i in share})
            continue
        results.update({items[i].nodeid: r for i, r in zip(share, json.loads(out.read_text()))})
    return results


@pytest.fixture
def interpreted(interpreted_results, request):
    """What this test's program (its name less test_, in tests/kernel_programs.py)
    returned under the interpreter; the test fails with its traceback if it raised."""
    result = interpreted_results[request.node.nodeid]
    if "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result["value"]


@pytest.mark.slow
def test_gemv_kernels_match_fp64_at_smollm2_and_ragged_shapes(interpreted):
    # bf16, int8, fp8, int4 in each group that fits K, and Q8_0's int8 where 32 divides K
    assert len(interpreted) == 8 + 8 + 6 + 6
    assert {"96x576 int8-g32", "64x1536 int4-g256", "37x200 fp8", "5x96 int4-g64"} <= set(interpreted)


@pytest.mark.slow
@pytest.mark.parametrize("swap", [False, True])
def test_few_rows_matmul_matches_fp64_for_every_format(swap, interpreted):
    assert len(interpreted) == 6 + 5 + 5 + 4 and {"960x576x5 q8_0", "37x200x17 int4-g128"} <= set(interpreted)
    assert {"int8 rows for each of 3 blocks", "int4-g32 rows for each of 3 blocks"} <= set(interpreted)
    assert {"int8 rows counted for each of 3 blocks", "int4-g32 rows counted for each of 3 blocks"} <= set(interpreted)


@pytest.mark.slow
def test_int4_words_matmul_matches_fp64(interpreted):
    assert interpreted == ["96x256x5 g32", "37x512x17 g128", "200x384x64 g64", "40x192x3 g64",
                           "int4-g64 rows for each of 3 blocks",
                           "int4-g64 rows counted for each of 3 blocks", "compiled"]


@pytest.mark.slow
def test_quantized_model_through_the_kernels_matches_its_dequantized_weights(interpreted):
    assert interpreted == ["float32 none", "float32 int8", "float32 fp8", "float32 int4", "bfloat16 none",
                           "bfloat16 int8", "bfloat16 fp8", "bfloat16 int4", "moe int8", "moe int4", "in place int8", "every expert int8",
                           "in place int4", "every expert int4", "in place int4-g64", "every expert int4-g64",
                           "in place q8_0", "every expert q8_0",
                           "in place bf16", "every expert bf16"]


@pytest.mark.slow
def test_dp4a_kernels_represent_x_within_their_bound(interpreted):
    """x's int8 planes inside the dp4a kernels hold x within step / 508 per
    block of inputs, at any scale and with outliers, read through identity
    weights (int8, and int4 with its nibble order and zero term)."""
    from brisklm.kernels import gemv
    assert 0 < interpreted <= 1 / (2 * gemv.X_LO) + 1e-5


@pytest.mark.slow
def test_int4_gemv_applies_the_norm_before_it(interpreted):
    """int4: the norm's weight folded into x's planes, its 1/rms into the sums;
    bf16: its weight into x, its 1/rms into the sums."""
    worst_int4, worst_bf16 = interpreted
    assert 0 < worst_int4 < 3e-4 and 0 < worst_bf16 < 3e-3


@pytest.mark.slow
def test_decode_attention_kernel_matches_fp64(interpreted):
    assert len(interpreted) == 5 + 3  # (five shapes, three sliding windows)


@pytest.mark.slow
def test_attention_kernel_over_a_few_new_tokens_matches_fp64(interpreted):
    assert len(interpreted) == 10


@pytest.mark.slow
def test_attention_kernel_applies_the_q_k_norms_as_the_model_does(interpreted):
    assert len(interpreted) == 2 * 2 * 2 * 2  # dtypes, offsets, caches, token counts


@pytest.mark.slow
def test_model_decodes_the_same_through_the_attention_kernel(interpreted):
    assert interpreted == [f"{family} kv_int8={int8}" for family in ("llama", "smollm3", "gemma3", "qwen3", "phi4-mini")
                           for int8 in (False, True)]


@pytest.mark.slow
def test_custom_ops_fake_implementations_and_schemas(interpreted):
    assert interpreted == 19  # (every op, the few-rows matmul in three formats, int4's words, both with counts)


def test_a_tuned_table_given_for_a_block_is_used_there_and_restored_after():
    from brisklm.kernels import gemv
    before = gemv.config(8, 4096, 4096)
    with gemv.tuned_table({"8:4096:4096": {"config": (8, 256, 2, 2)}}):
        assert gemv.config(8, 4096, 4096) == (8, 256, 2, 2)
        assert gemv.config(16, 1024, 4096) == gemv.DEFAULT_CONFIG[16]  # no width-16 entry: the default
    assert gemv.config(8, 4096, 4096) == before


def test_a_shape_not_measured_takes_the_nearest_measured_shapes_blocks_split_to_divide_k():
    from brisklm.kernels import gemv
    table = {"4d:4096:14336": {"config": (32, 512, 4, 4), "us": 12.4},
             "4d:28672:4096": {"config": (16, 1024, 1, 4), "us": 19.0},
             "16:4096:4096": {"config": (4, 512, 4, 4), "us": 9.5, "cublas_us": 12.2},
             "16:28672:4096": {"config": (2, 2048, 1, 4), "us": 55.0, "cublas_us": 54.8}}
    with gemv.tuned_table(table):
        assert gemv.config("4d", 4096, 12288, 128) == (32, 512, 4, 4)  # Qwen3-8B's w2
        assert gemv.config("4d", 5120, 17920, 128) == (32, 512, 5, 4)  # Phi-4's: 35 blocks, split 5
        assert gemv.config("4d", 24576, 4096, 128) == (16, 1024, 1, 4)  # Qwen3-8B's w13
        assert gemv.config("4d", 4096, 4100) == (32, 512, 1, 4)  # a ragged K: wide blocks, not split
        assert gemv.beats_dense(3840, 3840) and not gemv.beats_dense(24576, 4096)


@pytest.mark.parametrize("gpu,sms,takes", [("NVIDIA H200", 132, "NVIDIA H200"),
                                           ("NVIDIA H100 80GB HBM3", 132, "NVIDIA H200"),
                                           ("NVIDIA H100 PCIe", 114, None)])
def test_a_gpu_takes_what_its_table_lacks_from_a_measured_gpu_with_its_sms(monkeypatch, tmp_path, gpu, sms, takes):
    import types

    import torch

    from brisklm.kernels import gemv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(major=9, minor=0, multi_processor_count=sms))
    monkeypatch.setattr(gemv, "_tuned", None)
    with open(gemv.TUNED_FILE) as f:
        tables = json.load(f)
    expected = {k: v for k, v in tables[takes].items() if k != "_gpu"} if takes else {}
    assert gemv.tuned() == expected and (not takes or len(expected) > 10)
    if not takes:  # no measured blocks: the default blocks, K split so that the SMs have 4 programs each
        block_n, block_k, split, _ = gemv.config("4d", 6144, 4096, 128)
        assert (block_n, block_k) == gemv.DEFAULT_CONFIG["4d"][:2] and (6144 // block_n) * split >= 4 * sms
        assert gemv.config("4d", 128256, 4096, 128)[2] == 1  # (enough rows: not split)
    # its own entries first: a table of its own for one width keeps the other widths' from its kin
    own = {"4d:6144:4096": {"config": [8, 512, 2, 4], "us": 1.0}, "_gpu": {"capability": "9.0", "sms": sms}}
    monkeypatch.setattr(gemv, "TUNED_FILE", str(tmp_path / "tuned.json"))
    (tmp_path / "tuned.json").write_text(json.dumps({**tables, gpu: own}))
    monkeypatch.setattr(gemv, "_tuned", None)
    assert gemv.config("4d", 6144, 4096) == (8, 512, 2, 4)
    kin = {k: v for k, v in tables["NVIDIA H200"].items() if k != "_gpu"} if takes and gpu != "NVIDIA H200" else {}
    assert gemv.tuned() == {**kin, "4d:6144:4096": own["4d:6144:4096"]}


@pytest.mark.compile
def test_gemv_blocks_are_a_constant_of_the_traced_graph():
    """The GEMV ops take their block sizes as an argument, looked up while
    tracing without a graph break: a cached graph records them, so a retuned
    table cannot meet a stale graph (whose split-K output shape differs)."""
    import torch

    from brisklm.kernels import gemv
    gemv.traced_as_constants()  # (as load() does where it compiles: api.compiling)
    gemv._tuned = None  # the first lookup reads the table under the tracer
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def blocks(x, w):
        return x + gemv.scaled_config(w)[2]

    w = torch.zeros(4096, 14336, dtype=torch.bfloat16)
    assert blocks(torch.zeros(2), w).tolist() == [gemv.scaled_config(w)[2]] * 2
    assert len(graphs) == 1


def _f16(bits: int) -> float:
    import numpy as np
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


def _f16_bits(v: float) -> int:
    import numpy as np
    return int(np.array(v, dtype=np.float16).view(np.uint16))  # rounded to nearest, ties to even


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """A tiny interpreter of the PTX in the dp4a and fp8 kernels (and, shr,
    dp4a, mad; mov into halves, e4m3 and f16 conversions, f16x2 mul and fma,
    f32 add) on 32-bit register values, so the inline assembly that Triton's
    interpreter cannot run is checked here. f16x2 results are each half's
    exact value rounded once (exact in float64 at these magnitudes)."""
    import numpy as np
    import torch

    def value(a):
        return regs[a] if a in regs else int(a, 0)

    def halves(v):
        return _f16(v), _f16(v >> 16)

    def pack(lo, hi):
        return _f16_bits(lo) | _f16_bits(hi) << 16

    def e4m3(byte):
        return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())

    def lanes(v, signed):
        return [((v >> 8 * i & 255) ^ 128) - 128 if signed else v >> 8 * i & 255 for i in range(4)]

    def s32(v):
        return (v + 2**31) % 2**32 - 2**31

    for line in asm.splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) % 2**32 >> value(args[2])
        elif op.startswith("dp4a."):
            a_type, b_type = op.split(".")[1:]
            dot = sum(p * q for p, q in zip(lanes(value(args[1]) % 2**32, a_type == "s32"),
                                            lanes(value(args[2]) % 2**32, b_type == "s32")))
            regs[args[0]] = s32(dot + value(args[3]))
        elif op == "mad.lo.s32":
            regs[args[0]] = s32(value(args[1]) * value(args[2]) + value(args[3]))
        elif op == "mov.b32" and args[0].startswith("{"):
            v = value(args[2]) % 2**32
            regs[args[0][1:]], regs[args[1][:-1]] = v & 0xFFFF, v >> 16
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte into the low half
            v = value(args[1])
            regs[args[0]] = pack(e4m3(v & 255), e4m3(v >> 8 & 255))
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            a, b = halves(value(args[1])), halves(value(args[2]))
            c = halves(value(args[3])) if op.startswith("fma") else (0.0, 0.0)
            regs[args[0]] = pack(*(p * q + r for p, q, r in zip(a, b, c)))
        elif op == "cvt.f32.f16":
            regs[args[0]] = _f16(value(args[1]))  # floats held as Python floats from here
        elif op == "add.f32":
            regs[args[0]] = float(np.float32(np.float32(regs[args[1]]) + np.float32(regs[args[2]])))
        else:
            assert op in ("{", "}", ".reg"), op
    return regs


def test_dp4a_ptx_matches_the_interpreted_integer_path():
    """The dp4a kernels' inline PTX against the integer ops that the
    interpreter runs instead (the codes' nibble order, signedness, and the
    merge of the hi and lo planes), on random words."""
    import torch

    from brisklm.kernels import gemv
    rng = torch.Generator().manual_seed(0)

    def words(n):
        return [int(v) for v in torch.randint(-2**31, 2**31, (n,), generator=rng, dtype=torch.int64)]

    def signed_bytes(v):
        return [((v >> 8 * i & 255) ^ 128) - 128 for i in range(4)]

    for _ in range(200):
        w, xe_hi, xo_hi, xe_lo, xo_lo = words(5)
        codes = [(w >> 8 * (k // 2) + 4 * (1 - k % 2)) & 15 for k in range(8)]  # byte j: k = 2j high, 2j + 1 low
        x_hi = [v for pair in zip(signed_bytes(xe_hi), signed_bytes(xo_hi)) for v in pair]  # k = 0..7
        x_lo = [v for pair in zip(signed_bytes(xe_lo), signed_bytes(xo_lo)) for v in pair]
        want = sum(map(int.__mul__, codes, x_hi)) * gemv.X_LO + sum(map(int.__mul__, codes, x_lo))
        regs = _run_ptx(gemv.DP4A_INT4.value, {"$1": w, "$2": xe_hi, "$3": xo_hi, "$4": xe_lo, "$5": xo_lo})
        assert regs["$0"] == want
        want = sum(map(int.__mul__, signed_bytes(w), signed_bytes(xe_hi))) * gemv.X_LO \
            + sum(map(int.__mul__, signed_bytes(w), signed_bytes(xe_lo)))
        assert _run_ptx(gemv.DP4A_INT8.value, {"$1": w, "$2": xe_hi, "$3": xe_lo})["$0"] == want


def test_fp8_half_ptx_matches_fp16_arithmetic():
    """The fp8 kernel's PTX (gemv.FP8_HALF): 16 e4m3 codes (four words, the
    low byte first) times x as eight f16x2 pairs (input 2m in the low half):
    against the same sums done lane by lane in numpy's fp16 (inputs 2m in
    one lane, 2m + 1 in the other, each product added and rounded in turn),
    and within fp16's rounding of the exact dot product."""
    import numpy as np
    import torch

    from brisklm.kernels import gemv
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        codes = torch.randint(0, 256, (16,), generator=rng, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes (quantize_fp8 writes none)
        w = codes.view(torch.float8_e4m3fn).double().tolist()
        x = (torch.rand(16, generator=rng, dtype=torch.float64) * 16 - 8).half().double().tolist()
        words = [int(v) for v in codes.view(torch.int32)]
        pairs = [_f16_bits(x[2 * m]) | _f16_bits(x[2 * m + 1]) << 16 for m in range(8)]
        regs = {f"${1 + j}": words[j] for j in range(4)} | {f"${5 + m}": pairs[m] for m in range(8)}
        got = _run_ptx(gemv.FP8_HALF.value, regs)["$0"]
        lanes = [np.float16(0), np.float16(0)]
        for k in range(16):
            lanes[k % 2] = np.float16(float(lanes[k % 2]) + w[k] * x[k])
        assert got == float(np.float32(np.float32(lanes[0]) + np.float32(lanes[1])))
        exact = sum(a * b for a, b in zip(w, x))
        assert abs(got - exact) <= 16 * 2.0**-11 * sum(abs(a * b) for a, b in zip(w, x)) + 1e-6




def test_fusion_fuses_q_k_normed_attention(monkeypatch):
    """A model with q/k norms (Qwen3, Gemma 3) takes the decode attention kernel
    too: the norms are applied to its projections first (the kernel's own
    numbers against the plain model: test_model_decodes_the_same_through_the_attention_kernel)."""
    import torch
    from brisklm import fusion
    from brisklm.model import ModelArgs, build_model, random_state_dict
    monkeypatch.setattr(fusion.gemv, "available", lambda device: True)  # as on an NVIDIA GPU
    monkeypatch.setattr(fusion.attention_kernel, "supported", lambda *a: True)
    for qk_norm in (False, True):
        args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, qk_norm=qk_norm)
        model = fusion.fuse_for_decode(build_model(args, random_state_dict(args, torch.float32)))
        assert isinstance(model.layers[0].attention, fusion.FusedAttention) and model.decode_kernels["attention"]
        assert isinstance(model.layers[0].attention.q_norm, fusion.RMSNorm) == qk_norm
        assert isinstance(model.layers[1].feed_forward.w13, fusion.FusedLinear)
