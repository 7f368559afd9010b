"""The environment record of a results file: the versions (from the libraries table) and the hardware a result
was measured on."""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any


def environment_recorded(environment: Any) -> bool:
    """Whether a results document's ``environment`` records anything (a hand-made or edited file may have none)."""
    return isinstance(environment, dict) and any(environment.get(k) for k in ("torch", "transformers", "python", "packcheck"))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _package_version() -> str | None:
    """packcheck's version where it runs without its distribution (a version environment links the package)."""
    try:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    except OSError:
        return None
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else None


def environment(device: str = "cpu") -> dict[str, Any]:
    """The versions and hardware a result was measured on: the recorded libraries of
    :data:`~pytest_packcheck.versions.libraries.LIBRARIES` under their keys. No paths, no tokens."""
    from ..versions.libraries import installed_version, recorded_libraries

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "packcheck": _version("packcheck") or _package_version(),
        **{lib.key: installed_version(lib) for lib in recorded_libraries()},
        "device": device,
        "cuda": None,
        "device_name": platform.processor() or platform.machine(),
        "cpu_threads": None,
    }
    from ..backends import stand_in_active

    if stand_in_active():
        env["torch_varlen_kernel"] = "stand-in"  # PACKCHECK_TORCH_VARLEN_STAND_IN=1: a CPU rehearsal
    try:
        import torch

        env["cuda"] = torch.version.cuda
        env["cpu_threads"] = torch.get_num_threads()
        if device.startswith("cuda"):
            env["device_name"] = cuda_device_name(device)
    except ImportError:
        pass
    return env


def cuda_device_name(device: str) -> str:
    """The GPU's name without initialising CUDA in this process (``nvidia-smi``): the audit's controller forks
    the children that run the cells, and a child of a process that initialised CUDA cannot use it ("Cannot
    re-initialize CUDA in forked subprocess"). Falls back to torch once CUDA is initialised here anyway.

    nvidia-smi numbers GPUs in PCI order, CUDA fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: with
    different GPU models and another order, the names of all are given rather than a guess.
    """
    import shutil
    import subprocess

    names: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], check=False,
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        names = [line.strip() for line in out.splitlines() if line.strip()]
    if len(set(names)) == 1:
        return names[0]
    if names:
        index = device.split(":", 1)[1] if ":" in device else "0"
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if visible and index.isdigit() and int(index) < len(visible):
            index = visible[int(index)]
        if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and index.isdigit() and int(index) < len(names):
            return names[int(index)]
        return " / ".join(sorted(set(names))) + f" (mixed GPUs; which one is {device} depends on CUDA_DEVICE_ORDER)"
    import torch

    if torch.cuda.is_initialized():  # never is_available() first: it poisons fork unless asked through NVML
        return torch.cuda.get_device_name(torch.device(device))
    return "unknown GPU (no nvidia-smi; CUDA not initialised in the controller)"
