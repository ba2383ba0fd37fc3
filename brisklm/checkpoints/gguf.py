"""GGUF files (llama.cpp's format): hyper-parameters, tokenizer, chat template, weights.

Parsing and dequantization are the `gguf` library's (GGUFReader memory-maps
the file; gguf.quants.dequantize handles F32/F16/BF16, Q8_0, Q4_0, Q4_1 and
the K-quants). Reference: the GGUF specification in ggml's docs/gguf.md.

Shapes are reversed relative to torch (GGUF lists the fastest dimension
first); the reader's `data` is already row-major in torch order. llama.cpp's
converter permutes the q/k rows of 'llama' models for its interleaved RoPE;
we undo that permutation so the half-split RoPE of model.py applies to every
source alike.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from ..errors import BriskError
from ..model import ModelArgs, rope_frequencies
from ..tokenizer import Tokenizer, find_end_ids, from_gguf_vocab
from . import Checkpoint, assemble_from_hf_names, families

# llama.cpp stacks an MoE layer's experts, one tensor per projection
GGUF_EXPERTS = {"ffn_gate_exps.weight": "w1.weight", "ffn_up_exps.weight": "w3.weight",
                "ffn_down_exps.weight": "w2.weight"}

GGUF_LAYER = {  # GGUF per-layer names -> Hugging Face names
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",  # an MoE layer's router
}
GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
               "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

LLAMA3_ROPE_DEFAULTS = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def open_reader(path):
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map.

        Slicing an np.memmap makes a memmap object per slice; over the ~100k
        fields of a vocabulary that took most of the load time. A plain view
        reads the same mapped pages."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._mapping = mapped  # keeps the file mapped
            self._plain = mapped.view(np.ndarray)

        def _get_field_parts(self, offset, raw_type):
            """An array field in a few parts: a numeric array as one view, a
            string array one view a string (the library makes one or two
            views an element: most of a load's time for a vocabulary's
            ~100k entries). contents() reads them the same."""
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(offset, raw_type)
            item, length = self._get(offset, np.uint32), self._get(offset + 4, np.uint64)
            sub, n, start = GGUFValueType(int(item[0])), int(length[0]), offset + 12
            numeric = self.gguf_scalar_to_np.get(sub)
            if numeric is not None:
                values = self._get(start, numeric, n)
                return 12 + values.nbytes, [item, length, values], [2], [GGUFValueType.ARRAY, sub]
            if sub != GGUFValueType.STRING:  # (arrays of arrays: the library's way)
                return super()._get_field_parts(offset, raw_type)
            raw, lengths, at, strings = self.data, memoryview(self.data), start, []
            for _ in range(n):
                size = int.from_bytes(lengths[at:at + 8], "little")
                strings.append(raw[at + 8:at + 8 + size])
                at += 8 + size
            return at - offset, [item, length, *strings], list(range(2, 2 + n)), [GGUFValueType.ARRAY, sub]

    try:
        return Reader(path)
    except Exception as e:  # truncated data, bad magic, bad version, broken metadata
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BriskError(f"{path}: corrupt or truncated GGUF file ({msg})") from None


def metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def _f32(value) -> float:
    """The shortest decimal that a float32 field stands for (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def read_args(meta: dict, path: str, tensor_names) -> ModelArgs:
    family = families.from_gguf(meta.get("general.architecture"), path)
    arch = family.gguf

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full not in meta and required and default is None:
            raise BriskError(f"{path}: missing metadata field {full!r}")
        return meta.get(full, default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size", required=False) or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise BriskError(f"{path}: missing metadata field {arch + '.vocab_size'!r} "
                         f"(and no tokenizer.ggml.tokens)")
    experts = get("expert_count", 0, required=False)
    args = dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=get("feed_forward_length",
                              get("expert_feed_forward_length", required=False) if experts else None),
        num_hidden_layers=get("block_count"), num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", hidden // n_heads),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names)
    args = family.gguf_args(args, get)
    rotated = get("rope.dimension_count", args["head_dim"], required=False)
    if rotated != args["head_dim"]:  # (Phi-4-mini: RoPE on the first `rotated` dims of each head)
        args["partial_rotary_factor"] = rotated / args["head_dim"]
    if experts:  # (llama.cpp renormalizes the chosen experts' weights unless the file says not to)
        args.update(num_local_experts=experts, num_experts_per_tok=get("expert_used_count"),
                    moe_intermediate_size=get("expert_feed_forward_length", required=False),
                    norm_topk_prob=bool(get("expert_weights_norm", True, required=False)))
    kind = get("rope.scaling.type", "none", required=False)
    if kind == "linear":
        args["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif kind not in ("none", None):
        raise BriskError(f"{path}: unsupported rope scaling {kind!r}")
    if "rope_factors_long.weight" in tensor_names:  # Phi-3's LongRoPE, its factors as tensors
        factors = {kind: np.array(tensor_names[f"rope_factors_{kind}.weight"].data, dtype=np.float32).tolist()
                   for kind in ("long", "short")}
        args["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["long"],
                                "short_factor": factors["short"],
                                "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                                "attention_factor": get("rope.scaling.attn_factor", required=False)}
    try:
        return ModelArgs(**args)
    except (TypeError, ValueError) as e:
        raise BriskError(f"{path}: invalid hyper-parameters: {e}") from None


def _check_rope_freqs(args: ModelArgs, tensor, path) -> ModelArgs:
    """Llama 3.1 files store rope frequency divisors instead of the scaling recipe."""
    factors = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).flatten()
    base = rope_frequencies(ModelArgs(**{**args.to_dict(), "rope_scaling": None}))
    args.rope_scaling = dict(LLAMA3_ROPE_DEFAULTS)
    scaled = rope_frequencies(args)
    if factors.shape != base.shape or not torch.allclose(base / factors, scaled, rtol=1e-4):
        raise BriskError(f"{path}: unsupported rope_freqs.weight (not Llama 3.1's recipe)")
    return args


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order within each head."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def load_tokenizer(meta: dict, path: str) -> Tokenizer:
    g = lambda k, d=None: meta.get(f"tokenizer.ggml.{k}", d)  # noqa: E731
    if g("tokens") is None:
        raise BriskError(f"{path}: no tokenizer in the file (tokenizer.ggml.tokens)")
    try:
        backend = from_gguf_vocab(g("model"), g("pre"), list(g("tokens")),
                                  list(g("token_type", [])), g("merges"), g("scores"),
                                  bool(g("add_space_prefix", True)), g("unknown_token_id"))
    except ValueError as e:
        raise BriskError(f"{path}: {e}") from None
    eos = [g("eos_token_id"), g("eot_token_id"), g("eom_token_id")]
    add_bos = g("add_bos_token", g("model") == "llama")
    return Tokenizer(backend, g("bos_token_id"), find_end_ids(backend, eos), bool(add_bos),
                     meta.get("tokenizer.chat_template"))


def load_gguf(path: str, device, dtype, progress=None, keep_blocks=False, transform=None, plan=None) -> Checkpoint:
    """keep_blocks: False dequantizes every matrix; "all" keeps Q4_0/Q4_1
    matrices as int4 entries and Q8_0 ones as grouped int8 entries; "output"
    keeps the Q4 ones and, of the Q8_0 ones, only the output layer (also when
    it is the tied embedding)."""
    from gguf.quants import dequantize
    reader = open_reader(path)
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    args = read_args(meta, path, tensors)
    if "rope_freqs.weight" in tensors:
        args = _check_rope_freqs(args, tensors["rope_freqs.weight"], path)
    if plan:
        plan(args)
    family = families.from_gguf(meta["general.architecture"], path)
    layer_names = {**GGUF_LAYER, **family.gguf_names}
    by_hf = {}
    for name in tensors:
        if name in GGUF_GLOBAL:
            by_hf[GGUF_GLOBAL[name]] = name
        elif name.startswith("blk."):
            _, i, local = name.split(".", 2)
            if local in layer_names:
                by_hf[f"model.layers.{i}.{layer_names[local]}"] = name
            elif local in GGUF_EXPERTS:  # one expert: (the stacked tensor, its index)
                for e in range(args.num_local_experts):
                    by_hf[f"model.layers.{i}.block_sparse_moe.experts.{e}.{GGUF_EXPERTS[local]}"] = (name, e)
    widened = {}  # the last stacked experts' tensor, dequantized once for all its experts

    def widen(t, data, hf_name=None, world=1):
        """data (rows of tensor t, or all of it) dequantized to fp32; with
        hf_name, as our model holds it (1/world of the heads where a share)."""
        try:
            data = dequantize(data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise BriskError(f"{path}: tensor {t.name!r} of type {t.tensor_type.name}: {e}") from None
        if hf_name is None:
            return torch.from_numpy(np.asarray(data, dtype=np.float32))
        w = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
        if args.norm_offset and hf_name.endswith("norm.weight"):
            w -= args.norm_offset  # (llama.cpp stores Gemma's 1 + w; ours is w, see RMSNorm)
        if family.permuted_qk:
            if hf_name.endswith("q_proj.weight"):
                w = unpermute_qk(w, args.num_attention_heads // world)
            elif hf_name.endswith("k_proj.weight"):
                w = unpermute_qk(w, args.num_key_value_heads // world)
        return w

    def get(hf_name):
        name, expert = by_hf[hf_name] if isinstance(by_hf[hf_name], tuple) else (by_hf[hf_name], None)
        if name in widened:
            return widened[name][expert].clone()
        t = tensors[name]
        if expert is not None:
            widened.clear()
            widened[name] = widen(t, t.data)
            return widened[name][expert].clone()
        return widen(t, t.data, hf_name)

    def get_share(hf_name, dim, rank, world):
        """(full shape, block `rank` of `world` along dim): only its rows
        dequantized (the mapped file's other pages unread); a float tensor's
        columns likewise; anything else (stacked experts, quantized columns)
        dequantized whole, then sliced."""
        entry = by_hf[hf_name]
        t = None if isinstance(entry, tuple) else tensors[entry]
        floats = t is not None and t.tensor_type.name in ("F32", "F16", "BF16")
        if t is None or (dim == 1 and not floats):
            w = get(hf_name)
            size = w.shape[dim] // world
            return tuple(w.shape), w.narrow(dim, rank * size, size)
        full = tuple(int(n) for n in reversed(t.shape))  # (ggml lists the fastest dim first)
        size = full[dim] // world
        if full[dim] % world:  # (not the expected shape: the caller's check names it)
            return full, None
        part = slice(rank * size, (rank + 1) * size)
        data = t.data[part] if dim == 0 else np.ascontiguousarray(t.data[:, part])
        return full, widen(t, data, hf_name, world)

    gguf_names = {v: k for k, v in GGUF_GLOBAL.items()}
    gguf_names.update({v: k for k, v in layer_names.items()})

    def file_name(hf_name):
        if isinstance(by_hf.get(hf_name), tuple):
            return "{} (expert {})".format(*by_hf[hf_name])
        if hf_name.startswith("model.layers."):
            _, _, i, local = hf_name.split(".", 3)
            return f"blk.{i}.{gguf_names[local]}"
        return gguf_names[hf_name]

    # The vocabulary is rebuilt on another thread while the weights load: much of
    # either lets the other run (the tokenizer's build, the copies to the device).
    with ThreadPoolExecutor(1, thread_name_prefix="brisklm-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, meta, path)
        kept = {}
        if keep_blocks:
            if keep_blocks not in ("all", "output"):
                raise ValueError(f"keep_blocks must be False, 'all' or 'output', got {keep_blocks!r}")
            qk_heads = ({"q_proj": args.num_attention_heads, "k_proj": args.num_key_value_heads}
                        if family.permuted_qk else {})
            kept = keep_quantized_blocks(args, tensors, by_hf, qk_heads, device, keep_q8=keep_blocks)
        state = assemble_from_hf_names(args, get, by_hf.__contains__, device, dtype, path, file_name,
                                       progress, skip=kept, transform=transform, get_share=get_share)
        for name, parts in kept.items():
            state.update({f"{name}_{suffix}": t for suffix, t in parts.items()})
        if args.tie_word_embeddings and "output.weight" in kept:  # the embedding reads the same codes
            args = replace(args, tie_word_embeddings=False)
    return Checkpoint(args, state, tokenizer.result(), path)


# Q4_0 / Q4_1 blocks hold 32 weights: fp16 d, (Q4_1: fp16 m), 16 bytes of codes
# whose low nibbles are weights 0-15 and high nibbles weights 16-31.
# Q4_1: w = d * q + m = (q - 8) * d + (m + 8 d);  Q4_0: w = (q - 8) * d.
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def raw_blocks(tensor, block_bytes: int, device) -> torch.Tensor:
    """A block-quantized tensor's bytes as (N, blocks a row, block_bytes) uint8
    on device: the bits are unpacked there (on a GPU, in milliseconds)."""
    raw = np.asarray(tensor.data)
    with warnings.catch_warnings():  # (the mapped file is read-only; nothing writes to it)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(raw).to(device)
    return raw.reshape(raw.shape[0], -1, block_bytes)


def fp16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as fp32."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def int4_from_blocks(tensor, device="cpu"):
    """A Q4_0/Q4_1 tensor as (codes (N, K) uint8, scale, zero (N, K/32) fp32) on device."""
    kind = tensor.tensor_type.name
    blocks = raw_blocks(tensor, Q4_BLOCK_BYTES[kind], device)
    d = fp16_field(blocks, 0)
    if kind == "Q4_1":
        zero, qs = fp16_field(blocks, 2) + 8 * d, blocks[..., 4:]
    else:
        zero, qs = torch.zeros_like(d), blocks[..., 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(blocks.shape[0], -1)
    return codes, d, zero


def int8_from_blocks(tensor, device="cpu"):
    """A Q8_0 tensor (blocks of fp16 d and 32 int8 codes) as (codes (N, K) int8, scale (N, K/32) fp32) on device."""
    blocks = raw_blocks(tensor, 34, device)
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1)
    return codes, fp16_field(blocks, 0)


def keep_quantized_blocks(args, tensors, by_hf, qk_heads, device, keep_q8=None) -> dict:
    """int4 entries for every Linear whose GGUF tensors are all Q4_0/Q4_1, and
    grouped int8 entries for those that are all Q8_0 (keep_q8 "all"), or for the
    output layer only ("output"). A tied output layer kept so brings the
    embedding's entries too: the same codes, read by an int8 embedding."""
    from ..quantize import pack_int4, quantized_linear_names
    from . import hf_parts, rotary_rows
    kept = {}
    for name in quantized_linear_names(args):
        if ".experts." in name:  # (stacked in the file: dequantized, then quantized as asked)
            continue
        tied = name == "output.weight" and args.tie_word_embeddings
        parts = ["model.embed_tokens.weight"] if tied else hf_parts(name)
        if not all(p in by_hf for p in parts):
            continue
        kinds = {tensors[by_hf[p]].tensor_type.name for p in parts}
        if kinds <= set(Q4_BLOCK_BYTES) and not tied:
            read = int4_from_blocks
        elif kinds == {"Q8_0"} and (keep_q8 == "all" or (keep_q8 == "output" and name == "output.weight")):
            read = int8_from_blocks
        else:
            continue
        pieces = []
        for p in parts:
            arrays = read(tensors[by_hf[p]], device)
            heads = qk_heads.get(p.split(".")[-2])
            if heads:  # undo llama.cpp's q/k row order, as for dense weights
                arrays = tuple(unpermute_qk(t, heads) for t in arrays)
            pieces.append(arrays)
        joined = [rotary_rows(args, name, torch.cat(ts)) for ts in zip(*pieces)]
        if read is int4_from_blocks:
            kept[name] = {"int4": pack_int4(joined[0]), "scale": joined[1], "zero": joined[2]}
        else:
            kept[name] = {"int8": joined[0], "scale": joined[1]}
            if tied:
                kept["tok_embeddings.weight"] = kept[name]
    return kept
