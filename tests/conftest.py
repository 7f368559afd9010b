"""Shared fixtures: a local Hub cache holding real config.json files, and tiny model workbenches."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import tomllib
from _pytest import pytester as _pytester

#: Libraries pytester must not unload: it restores sys.modules after each test that uses it, so an extension module
#: first imported inside such a test was imported a second time by a later one ("cannot load module more than
#: once per process", a segfault in torch), and a transformers whose lazily imported submodules were removed could
#: not import them again ("Could not import module 'AriaTextConfig'"): results depended on the order of the tests.
_KEEP_LOADED = {"numpy", "torch", "transformers", "trl", "accelerate", "safetensors", "tokenizers", "huggingface_hub",
                "pytest_packcheck", "functorch", "sympy", "scipy", "datasets", "pyarrow", "pandas"}
_snapshot_init = _pytester.SysModulesSnapshot.__init__


def _keep_libraries_loaded(self, preserve=None):
    _snapshot_init(self, preserve=lambda name: name.split(".")[0] in _KEEP_LOADED or bool(preserve and preserve(name)))


_pytester.SysModulesSnapshot.__init__ = _keep_libraries_loaded

HUB_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "hub-configs"
LOCAL_HUB_CONFIGS = Path(__file__).resolve().parent / "data" / "hub-configs"
REPO = Path(__file__).resolve().parents[1]


def hub_configs_dir() -> Path:
    """../shared/hub-configs when present (developer checkout), else the copy under tests/data."""
    return HUB_CONFIGS if HUB_CONFIGS.is_dir() else LOCAL_HUB_CONFIGS


def fake_sha(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


def lay_out_hub_cache(hub_dir: Path, repo_ids: list[str]) -> dict[str, str]:
    """Lay out ``hub_dir`` as huggingface_hub's cache does (blobs, snapshots/<sha>, refs/main) for the given
    repos, each holding its real config.json. Returns repo_id -> commit SHA."""
    shas = {}
    for repo_id in repo_ids:
        src = hub_configs_dir() / repo_id / "config.json"
        if not src.exists():  # a config only the tests' copy has (Qwen2-VL: see tests/data/hub-configs/SOURCES.md)
            src = LOCAL_HUB_CONFIGS / repo_id / "config.json"
        base = hub_dir / f"models--{repo_id.replace('/', '--')}"
        sha = fake_sha(repo_id)
        blob = hashlib.sha256(src.read_bytes()).hexdigest()
        (base / "blobs").mkdir(parents=True, exist_ok=True)
        shutil.copy(src, base / "blobs" / blob)
        snap = base / "snapshots" / sha
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").symlink_to(Path("../../blobs") / blob)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(sha)
        shas[repo_id] = sha
    return shas


def add_snapshot(hub_dir: Path, repo_id: str, changes: dict, ref: str | None = None) -> str:
    """A second snapshot of a repo already laid out in ``hub_dir``: its config.json with ``changes``, under its own
    commit SHA (refs/main keeps pointing at the first one; ``ref`` names a branch or tag for the new one). Returns
    the new SHA."""
    import json

    base = hub_dir / f"models--{repo_id.replace('/', '--')}"
    text = json.dumps({**json.loads((hub_configs_dir() / repo_id / "config.json").read_text()), **changes}, indent=2)
    sha = fake_sha(repo_id + json.dumps(changes, sort_keys=True))
    blob = hashlib.sha256(text.encode()).hexdigest()
    (base / "blobs" / blob).write_text(text)
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").symlink_to(Path("../../blobs") / blob)
    if ref:
        (base / "refs" / ref).write_text(sha)
    return sha


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (real version environments beyond the one in .ci/run) run on demand: PACKCHECK_RUN_SLOW=1."""
    import os

    if os.environ.get("PACKCHECK_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set PACKCHECK_RUN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread():
    """Each process that runs tests (an xdist worker, or the -n 0 process) computes on one intra-op torch thread,
    unless OMP_NUM_THREADS is set. README's command runs 2 workers on 2 cores: torch's default of one thread per core
    put 4 OpenMP threads on 2 cores, whose spinning cost more CPU than the tiny models' matmuls (the reason
    run/process.py's limit_threads gives packcheck's own tiny-model cells one thread). A worker was already left on
    one thread after its first in-process audit (limit_threads does not restore it), so the count depended on the
    order of the tests; now it is one from the start. Subprocesses are untouched: they run as a user starts them."""
    import os

    if os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """HF_HOME in a temp dir, HF_HUB_OFFLINE=1, with real configs of a few Hub models cached."""
    home = tmp_path / "hf_home"
    shas = lay_out_hub_cache(home / "hub", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B", "facebook/opt-125m", "google/gemma-2-2b-it"])
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    try:
        import transformers.utils.hub as th

        monkeypatch.setattr(th, "HF_HUB_CACHE", str(home / "hub"), raising=False)
    except ImportError:
        pass
    return shas


@pytest.fixture
def two_snapshots(offline_hub, tmp_path: Path) -> dict[str, str]:
    """The offline Hub cache with a second, older snapshot of meta-llama/Llama-3.2-1B (3 layers, rope_theta 10000,
    also reachable as the branch ``v1``): ``main`` and ``old`` are the two commit SHAs."""
    repo = "meta-llama/Llama-3.2-1B"
    old = add_snapshot(tmp_path / "hf_home" / "hub", repo, {"num_hidden_layers": 3, "rope_theta": 10000.0}, ref="v1")
    return {"repo": repo, "main": offline_hub[repo], "old": old}


@pytest.fixture(scope="session")
def tolerances() -> dict:
    return tomllib.loads((REPO / "audit" / "tolerances.toml").read_text())


def make_bench(model_type: str, backend: str, tolerances: dict, **kwargs):
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    ensure_registered(backend)
    resolved = resolve_model(parse_model_spec(f"arch:{model_type}", "test"), "test")
    model = build_model(resolved, backend, "float32")
    return Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tolerances["float32"], **kwargs)


@pytest.fixture
def llama_sdpa(tolerances):
    """The correct stack: tiny llama on sdpa (checks call it with use_cache=False)."""
    return make_bench("llama", "sdpa", tolerances)


def planted_cell(model: str, backend: str | None, check: str, status: str, cause: str | None = None,
                 message: str | None = None, **metrics) -> dict:
    """One planted result cell as the results file holds it (``CellResult`` round-tripped through JSON), for the
    rendering tests: no model is built. ``backend`` None is a model-level check (collate)."""
    import json

    from pytest_packcheck.results.schema import CellResult

    c = CellResult(cell_id="-".join(x for x in (model, backend, check, "float32") if x), model={
        "label": model, "model_type": model, "model_class": "M", "revision": None}, backend=backend, check=check,
        dtype="float32", status=status, metrics=metrics, message=message or f"{check} {status}", cause=cause,
        evidence={"moved": 0.3} if cause else {})
    return json.loads(c.to_json())


def planted_doc(cells: list[dict]) -> dict:
    """A diagnosed results document around planted cells (backends and checks in registry order)."""
    from pytest_packcheck.analysis.diagnose import diagnose_document
    from pytest_packcheck.checks.registry import REGISTRY

    backends = sorted({c["backend"] for c in cells if c["backend"]})
    checks = [s.name for s in REGISTRY if any(c["check"] == s.name for c in cells)]
    return diagnose_document({"schema_version": 2, "environment": {"transformers": "5.24.0", "device": "cpu"}, "command": "x",
                              "settings": {"backends": backends, "checks": checks}, "cells": cells})
