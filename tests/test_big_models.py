"""Models larger than the device in their dense form: quantized tensor by
tensor while loading (never whole in bf16), a memory plan that refuses
before loading what cannot fit, and out-of-memory errors as one line."""
import os
import subprocess
import sys

import pytest
import torch

import brisklm
from brisklm import loading, memory
from brisklm.checkpoints import load as load_checkpoint
from brisklm.errors import BriskError
from brisklm.model import ModelArgs, random_state_dict
from brisklm.quantize import quantize_state_dict, quantizer, untied

import forked_brisk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def same_entries(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("mode,group", [("int8", 128), ("q8_0", 128), ("int4", 32), ("fp8", 128)])
def test_a_preset_quantized_as_it_is_built_equals_one_quantized_after(mode, group):
    streamed = random_state_dict(TINY, torch.bfloat16, transform=quantizer(mode, group))
    args, after = quantize_state_dict(TINY, random_state_dict(TINY, torch.bfloat16), mode, group)
    same_entries(streamed, after)
    assert untied(TINY, streamed) == args and not args.tie_word_embeddings  # the output layer has its own codes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_real_model_quantized_while_loading_equals_brisk_quantize_then_load(smollm2_gguf, tmp_path, mode):
    """The bundled GGUF (tied Q8_0 embedding, Q4_1 layers), dequantized and
    requantized tensor by tensor as it is read, against `brisk quantize`'s
    file read back: the same entries, bit for bit."""
    out = str(tmp_path / mode)
    cmd = ["quantize", "--checkpoint_path", smollm2_gguf, "--mode", mode, "--groupsize", "32", "--dtype", "bfloat16",
           "--output", out]
    done = forked_brisk.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tensor by tensor" in done.stderr
    written = load_checkpoint(out, dtype=torch.bfloat16).state_dict
    loaded = load_checkpoint(smollm2_gguf, dtype=torch.bfloat16, transform=quantizer(mode, 32)).state_dict
    same_entries(loaded, written)


PEAK_CHILD = r"""
import sys, torch
from brisklm.model import ModelArgs, random_state_dict
from brisklm.quantize import quantizer
args = ModelArgs(vocab_size=8000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=8)
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
torch.ones(1)  # torch's own start-up allocations before the baseline
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here on
state = random_state_dict(args, torch.bfloat16, transform=quantizer("int8") if sys.argv[1] == "int8" else None)
kept = sum(t.numel() * t.element_size() for t in state.values())
print(rss("VmHWM:") - before, kept)
"""


def peaks_and_kept(*modes):
    """(peak, kept) bytes of a child process building the model in each mode, all at once."""
    # A fixed mmap threshold: glibc otherwise raises it after each large free
    # and keeps freed blocks of up to 32 MB in its heap, which RSS counts.
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    children = [subprocess.Popen([sys.executable, "-c", PEAK_CHILD, mode], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for mode in modes]
    results = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-2000:]
        results.append(tuple(map(int, out.split())))
    return results


@pytest.mark.slow
def test_quantizing_while_building_peaks_at_the_quantized_size_plus_one_tensor():
    """A 0.42 B-parameter model (0.84 GB in bf16, 0.42 GB in int8), measured
    as the process's peak resident memory: built in bf16 it grows by all of
    it; quantized as it is built, by its int8 size plus the temporaries of
    one tensor (the largest, w13: 34 MB in fp32, a few copies of it while it
    is quantized)."""
    (dense_peak, dense), (int8_peak, int8) = peaks_and_kept("none", "int8")  # (each its own process's peak)
    assert dense > 0.8e9 and dense_peak >= dense  # (the measurement sees the memory)
    largest_fp32 = 2 * 4096 * 1024 * 4
    assert int8 < 0.52 * dense and int8_peak < int8 + 5 * largest_fp32 and int8_peak < 0.75 * dense, \
        (int8_peak, int8, dense)


def test_weights_that_cannot_fit_are_refused_before_loading_with_what_would_fit(monkeypatch):
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 100e9)
    monkeypatch.setattr(loading, "random_state_dict", lambda *a, **k: pytest.fail("loaded anyway"))
    with pytest.raises(BriskError) as e:
        brisklm.load(preset="llama-3.1-70b", device="cpu", quantize="none")
    message = str(e.value)
    assert "\n" not in message and message.startswith("llama-3.1-70b: 141.1 GB of bfloat16 weights")
    assert "100.0 GB free on cpu" in message and "--quantize int8 (70.7 GB)" in message
    assert "--quantize int4 --groupsize 128 (40.7 GB)" in message


def test_a_plan_that_fits_is_printed(monkeypatch, capsys):
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 100e9)
    monkeypatch.setattr(loading, "random_state_dict", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # (stopped once the plan is made)
        brisklm.load(preset="llama-3.1-70b", device="cpu", quantize="int8", max_seq_length=8192, quiet=False)
    err = capsys.readouterr().err
    assert "Memory plan on cpu: 70.7 GB of int8 weights + 2.7 GB of KV cache (8192 tokens), 100.0 GB free" in err
    assert "quantizing to int8 tensor by tensor" in err


def test_out_of_memory_while_loading_is_one_line_with_the_numbers(monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.75 GiB\nmore detail")
    monkeypatch.setattr(loading, "random_state_dict", oom)
    with pytest.raises(BriskError) as e:
        brisklm.load(preset="smollm2-135m", device="cpu", quantize="int8")
    message = str(e.value)
    assert "\n" not in message and "out of memory on cpu while building the weights" in message
    assert "GB free now" in message and "Tried to allocate 1.75 GiB" in message


def test_out_of_memory_anywhere_in_the_cli_is_one_line_and_exit_code_2(monkeypatch, capsys):
    from brisklm import cli

    def generate(args):  # e.g. the KV cache of a long generation, or a compile
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nPyTorch detail")
    monkeypatch.setitem(cli.COMMANDS, "generate", generate)
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: out of memory during `brisk generate`")
    assert "Tried to allocate 8.00 GiB" in err and "Traceback" not in err


def test_a_native_folder_written_in_shards_reads_back_bit_for_bit(tmp_path):
    """NativeWriter holds tensors until a shard is full, writes it and drops
    them: at most one shard plus one tensor is ever held, the folder has
    several shards, and it reads back entry for entry."""
    from brisklm.checkpoints.native import NativeWriter, save_native
    qargs, state = quantize_state_dict(TINY, random_state_dict(TINY, torch.float32), "int4", 32)
    largest = max(t.numel() * t.element_size() for t in state.values())
    whole, sharded = str(tmp_path / "whole"), str(tmp_path / "sharded")
    save_native(whole, qargs, state, None)
    writer = NativeWriter(sharded, shard_bytes=20_000)
    for key, t in state.items():
        writer.add(key, t)
    writer.finish(qargs, None)
    assert writer.shards >= 3 and writer.peak_held < 20_000 + largest
    assert sorted(os.listdir(whole)) == ["brisk.json", "model.safetensors"]
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) == writer.shards
    same_entries(load_checkpoint(sharded).state_dict, load_checkpoint(whole).state_dict)


def test_stacking_experts_does_not_keep_the_loaded_copies_alive(monkeypatch):
    """Preparing an MoE stacks each expert tensor name into one tensor; the
    tensors as loaded must be garbage by then, else the experts are held
    twice while loading (bf16 Mixtral, 2 x 93 GB, did not fit an H200)."""
    import weakref

    from brisklm.model import MoEFeedForward
    loaded, alive_at_prepare = [], []
    build, prepare = loading.build_model, MoEFeedForward.prepare

    def build_model(args, state, formats=None):
        loaded.extend(weakref.ref(t) for name, t in state.items() if ".experts." in name)
        return build(args, state, formats)

    def prepare_after_check(self, device, compiled=False):
        alive_at_prepare.append(sum(r() is not None for r in loaded))
        return prepare(self, device, compiled)

    monkeypatch.setattr(loading, "build_model", build_model)
    monkeypatch.setattr(MoEFeedForward, "prepare", prepare_after_check)
    brisklm.load(preset="tiny-moe", device="cpu", compile=False)
    assert loaded and alive_at_prepare and alive_at_prepare == [0] * len(alive_at_prepare)


def test_a_quantized_native_folder_is_planned_at_what_it_stores(tmp_path, monkeypatch, capsys):
    """An int4 folder from `brisk quantize` loads where its dense model would
    not fit: the plan reads the folder's tensors, not the dense shapes."""
    from brisklm.checkpoints.native import save_native
    from brisklm.model import canonical_names
    args = ModelArgs(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
    dense = random_state_dict(args, torch.float32, std=0.1)
    dense_bytes = sum(t.numel() * 2 for t in dense.values())  # in bf16
    qargs, state = quantize_state_dict(args, dense, "int4", 32)
    save_native(str(tmp_path), qargs, state, None, quantization={"mode": "int4"})
    names = set(canonical_names(qargs))  # dense tensors load in bf16, quantized entries as they are
    stored = sum(t.numel() * (2 if k in names else t.element_size()) for k, t in state.items())
    assert stored < 0.5 * dense_bytes
    free = (stored + dense_bytes) / 2 / memory.PLAN_SHARE  # room for the int4 folder, not for the dense model
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: free)
    llm = brisklm.load(str(tmp_path), device="cpu", dtype="bfloat16", max_seq_length=16, quiet=False)
    err = capsys.readouterr().err
    assert f"Memory plan on cpu: {stored / 1e6:.0f} MB of weights (as stored)" in err, (err, stored)
    assert len(llm.score([1, 2, 3])[0]) == 2  # (it loaded, and runs)
