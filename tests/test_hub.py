"""Hugging Face repo ids as checkpoints, and `brisk list`, against a hub cache
built here in huggingface_hub's layout (blobs, snapshots of links to them,
refs/ naming commits): no network."""
import json
import os
import shutil

import pytest

from brisklm.checkpoints import resolve
from brisklm.checkpoints import hub
from brisklm.cli import main
from brisklm.errors import BriskError

COMMIT, OLD_COMMIT = "a" * 40, "b1c2d3e4f5" + "0" * 30
TINY, GGUF_REPO, QUANTS = "org/tiny-llama", "org/smol-gguf", "org/smol-quants"
TEXT = "The capital of France is Paris. Once upon a time there was a fox who lived by the sea. " * 4


def tiny_hf_model(folder) -> str:
    """A tiny random Llama with a byte-level BPE trained on TEXT, saved by transformers."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def add_snapshot(cache, repo, files: dict, commit=COMMIT, branch="main"):
    """Lay files (name -> a file to take) out as huggingface_hub does: each a
    blob, the snapshot a folder of relative links to the blobs, refs/branch
    the commit. A large file's blob is a link to it, not a copy."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = root / "blobs" / f"{commit[:8]}-{name}"
        if os.path.getsize(source) > 1 << 20:
            blob.symlink_to(os.path.abspath(source))
        else:
            shutil.copyfile(source, blob)
        (root / "snapshots" / commit / name).symlink_to(os.path.relpath(blob, root / "snapshots" / commit))
    if branch:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / branch).write_text(commit)
    return str(root / "snapshots" / commit)


def build_fake_hub(cache, gguf) -> dict:
    """A hub cache holding a tiny HF model (main, and an older commit tagged
    v0), a repo of one GGUF file (the bundled model) and a repo of two, and a
    repo of which only the config and tokenizer were fetched."""
    model = tiny_hf_model(cache.parent / "tiny-saved")
    files = {f: os.path.join(model, f) for f in os.listdir(model)}
    snapshots = {TINY: add_snapshot(cache, TINY, files),
                 TINY + "@v0": add_snapshot(cache, TINY, files, OLD_COMMIT, branch="v0"),
                 GGUF_REPO: add_snapshot(cache, GGUF_REPO, {"smol.Q4_1.gguf": gguf}),
                 QUANTS: add_snapshot(cache, QUANTS, {"smol.Q4_1.gguf": gguf, "smol.Q8_0.gguf": gguf})}
    add_snapshot(cache, "org/tokenizer-only", {f: files[f] for f in files if not f.endswith(".safetensors")})
    return snapshots


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory, smollm2_gguf):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    return cache, build_fake_hub(cache, smollm2_gguf)


@pytest.fixture
def hub_env(fake_hub, monkeypatch, tmp_path):
    cache, snapshots = fake_hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("BRISKLM_CACHE", str(tmp_path / "brisk"))
    monkeypatch.delenv(hub.DOWNLOAD_ENV, raising=False)
    return snapshots


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("text, parts", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None, None, None)),
    ("org/name@v1.0", ("org/name", "v1.0", None, None)),
    ("org/name-GGUF/name.Q4_K_M.gguf", ("org/name-GGUF", None, "name.Q4_K_M.gguf", None)),
    ("org/name-GGUF@main:q4_k_m", ("org/name-GGUF", "main", None, "q4_k_m")),
])
def test_a_repo_id_is_parsed_into_repo_revision_and_file(text, parts):
    ref = hub.parse_repo_id(text)
    assert (ref.repo, ref.revision, ref.file, ref.tag) == parts


@pytest.mark.parametrize("text", ["model.gguf", "./org/name", "/abs/path", "~/models/x", "a/b/c", "org/"])
def test_paths_are_not_taken_for_repo_ids(text):
    assert hub.parse_repo_id(text) is None


def test_the_hub_cache_is_found_where_huggingface_hub_puts_it(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BRISKLM_CACHE", str(tmp_path / "brisk"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.hub_caches() == [str(tmp_path / ".cache/huggingface/hub"), str(tmp_path / "brisk/hub")]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub.hub_caches()[0] == str(tmp_path / "hf/hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "brisk/hub"))  # (the same folder is searched once)
    assert hub.hub_caches() == [str(tmp_path / "brisk/hub")]


def test_a_repo_id_resolves_to_its_snapshot_in_the_hub_cache(hub_env):
    assert resolve(TINY) == ("hf", hub_env[TINY])
    assert resolve("ORG/Tiny-Llama") == ("hf", hub_env[TINY])  # (ids are case-insensitive on the hub)


def test_a_revision_resolves_by_branch_or_commit_prefix(hub_env):
    assert resolve(TINY + "@v0") == ("hf", hub_env[TINY + "@v0"])
    assert resolve(TINY + "@" + OLD_COMMIT[:10]) == ("hf", hub_env[TINY + "@v0"])
    assert resolve(TINY + "@" + COMMIT) == ("hf", hub_env[TINY])


def test_a_repo_of_one_gguf_file_resolves_to_the_file(hub_env):
    assert resolve(GGUF_REPO) == ("gguf", os.path.join(hub_env[GGUF_REPO], "smol.Q4_1.gguf"))


def test_a_repo_of_several_gguf_files_takes_one_by_name_or_quantization(hub_env):
    q8 = os.path.join(hub_env[QUANTS], "smol.Q8_0.gguf")
    assert resolve(QUANTS + "/smol.Q8_0.gguf") == ("gguf", q8)
    assert resolve(QUANTS + ":q8_0") == ("gguf", q8)
    with pytest.raises(BriskError, match=r"holds 2 GGUF files \(smol.Q4_1.gguf, smol.Q8_0.gguf\); name one"):
        resolve(QUANTS)
    with pytest.raises(BriskError, match="no GGUF files of the cached snapshot match 'Q2_K'.*`brisk download "
                                         f"{QUANTS}:Q2_K` fetches it"):
        resolve(QUANTS + ":Q2_K")


def test_brisklm_load_takes_a_repo_id_and_generates(hub_env):
    import brisklm
    llm = brisklm.load(TINY, device="cpu", dtype="float32", max_seq_length=64)
    assert llm.name == hub_env[TINY]
    assert len(llm.generate("The capital of France is", max_new_tokens=4)) > 0


def test_a_repo_not_in_the_cache_is_one_line_naming_the_command_that_fetches_it(hub_env, capsys):
    line = error_line(capsys, ["generate", "--checkpoint_path", "org/absent", "--max_new_tokens", "1"])
    assert "org/absent: no such file or folder" in line and "not in the Hugging Face hub caches" in line
    assert "`brisk download org/absent` fetches it" in line and f"{hub.DOWNLOAD_ENV}=1" in line
    line = error_line(capsys, ["generate", "--checkpoint_path", TINY + "@v9", "--max_new_tokens", "1"])
    assert f"`brisk download {TINY}@v9`" in line


def test_a_snapshot_of_only_config_and_tokenizer_asks_for_the_download(hub_env, capsys):
    line = error_line(capsys, ["generate", "--checkpoint_path", "org/tokenizer-only"])
    assert "holds only its config and tokenizer" in line and "`brisk download org/tokenizer-only`" in line


def test_download_on_load_is_asked_for_by_the_environment(hub_env, monkeypatch, tmp_path):
    """BRISKLM_DOWNLOAD=1 fetches a repo id not in the caches (huggingface_hub
    stood in for here), one GGUF file of a repo of several."""
    import huggingface_hub
    asked = {}

    def fake_snapshot_download(repo, revision=None, allow_patterns=None, cache_dir=None):
        asked.update(repo=repo, patterns=allow_patterns)
        return add_snapshot(tmp_path / "fetched", repo, {"x.Q4_1.gguf": hub_env[GGUF_REPO] + "/smol.Q4_1.gguf"})
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, revision=None: [
        "README.md", "x.Q4_1.gguf", "x.Q8_0.gguf"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(BriskError, match="not in the Hugging Face hub caches"):
        resolve("org/remote:Q4_1")
    monkeypatch.setenv(hub.DOWNLOAD_ENV, "1")
    kind, path = resolve("org/remote:Q4_1")
    assert kind == "gguf" and path.endswith("x.Q4_1.gguf")
    assert asked == {"repo": "org/remote", "patterns": ["x.Q4_1.gguf"]}


@pytest.mark.parametrize("files, text, patterns", [
    (["config.json", "model.safetensors", "tokenizer.json", "model.Q4_0.gguf"], "org/m",
     ["*.json", "tokenizer.model", "*.tiktoken", "*.jinja", "*.safetensors"]),
    (["config.json", "pytorch_model.bin"], "org/m",
     ["*.json", "tokenizer.model", "*.tiktoken", "*.jinja", "pytorch_model*.bin"]),
    (["README.md", "m.Q4_0.gguf"], "org/m", ["m.Q4_0.gguf"]),
    (["m.Q4_0.gguf", "m.Q8_0.gguf", "sub/m.F16.gguf"], "org/m:Q8_0", ["m.Q8_0.gguf"]),
])
def test_a_download_fetches_the_weights_the_model_needs_and_one_gguf_file(files, text, patterns):
    assert hub.download_patterns(hub.parse_repo_id(text), files) == patterns


def test_a_download_of_a_repo_of_several_gguf_files_asks_which(capsys):
    with pytest.raises(BriskError, match=r"holds 2 GGUF files .*org/m/m.Q4_0.gguf or by its quantization"):
        hub.download_patterns(hub.parse_repo_id("org/m"), ["m.Q4_0.gguf", "m.Q8_0.gguf"])


def test_brisk_list_names_each_model_the_caches_hold(hub_env, capsys, smollm2_gguf, tmp_path):
    os.makedirs(tmp_path / "brisk")
    os.symlink(smollm2_gguf, tmp_path / "brisk" / hub.DEFAULT_FILE)
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {name: r["format"] for name, r in rows.items()} == {
        hub.DEFAULT_FILE: "gguf", TINY: "hf", f"{TINY}@v0": "hf", GGUF_REPO: "gguf",
        f"{QUANTS}/smol.Q4_1.gguf": "gguf", f"{QUANTS}/smol.Q8_0.gguf": "gguf"}
    assert rows[GGUF_REPO]["bytes"] == os.path.getsize(smollm2_gguf)
    assert 0 < rows[TINY]["bytes"] < 1e6 and rows[TINY]["path"] == hub_env[TINY]
    for name, row in rows.items():  # every name listed is a checkpoint that resolves to its path
        assert resolve(name)[1] == row["path"], name
    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "FORMAT", "SIZE", "PATH"] and len(table) == 1 + len(rows)
    assert any(line.split()[:4] == [GGUF_REPO, "gguf", "98", "MB"] for line in table)


def test_brisk_list_with_empty_caches_says_so_and_how_to_fetch(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("BRISKLM_CACHE", str(tmp_path / "brisk"))
    monkeypatch.setattr(hub, "_installed_package_file", lambda: None)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No models cached") and "`brisk download org/name`" in out
    assert main(["list", "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_quantizing_a_repo_id_writes_beside_the_user_not_into_the_hub_cache(hub_env, monkeypatch, tmp_path):
    """The default output of `brisk quantize org/name` is ./name-int8 (inside the
    hub's snapshots/ it would list as a revision of the repo)."""
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--checkpoint_path", TINY, "--mode", "int8"]) == 0
    assert (tmp_path / (TINY.split("/")[-1] + "-int8") / "brisk.json").exists()
    assert not any(name.endswith("-int8") for name in os.listdir(os.path.dirname(hub_env[TINY])))
