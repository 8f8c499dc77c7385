"""`hf-scale env`: versions, devices, DeepSpeed's compiled ops and what is missing, for bug reports."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "optuna", "datasets", "evaluate", "tokenizers")
OPTIONAL = ("plotly", "psycopg2-binary", "tensorboard", "wandb", "mlflow")
# DeepSpeed ops the presets use: every CPU run needs the shared-memory communication op, offload needs CPU Adam.
DEEPSPEED_OPS = ("deepspeed_shm_comm", "cpu_adam", "fused_adam")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> dict[str, Any]:
    import torch

    devices: dict[str, Any] = {"cpu_cores": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        from hf_scale.hardware import gpu_from_device_name

        devices["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
                "planner_catalogue": getattr(gpu_from_device_name(torch.cuda.get_device_name(i)), "name", None),
            }
            for i in range(torch.cuda.device_count())
        ]
    return devices


def environment_report() -> dict[str, Any]:
    """Everything `hf-scale env` prints, as a dict."""
    versions = {package: _version(package) for package in PACKAGES}
    # Which DeepSpeed ops are already compiled in TORCH_EXTENSIONS_DIR (otherwise the first run compiles them).
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
    built = {path.parent.name for path in Path(extensions).rglob("*.so")} if extensions else set()
    return {
        "hf_scale": _version("hf-scale"),
        "packages": versions,
        "optional": {package: _version(package) for package in OPTIONAL},
        "devices": _devices(),
        "torch_extensions_dir": extensions,
        "deepspeed_ops_compiled": {op: op in built for op in DEEPSPEED_OPS} if extensions else {},
        "missing": [package for package, version in versions.items() if version is None],
        "hub_offline": os.environ.get("HF_HUB_OFFLINE") == "1",
    }


def render_environment(report: dict[str, Any]) -> str:
    lines = [f"hf_scale {report['hf_scale']}"]
    lines += [f"  {name:<14}{version or 'MISSING'}" for name, version in report["packages"].items()]
    optional = ", ".join(f"{n} {v}" if v else f"{n} (not installed)" for n, v in report["optional"].items())
    lines.append(f"optional: {optional}")
    devices = report["devices"]
    lines.append(f"CPU cores: {devices['cpu_cores']}; CUDA: {'yes' if devices['cuda_available'] else 'no'}")
    for gpu in devices.get("gpus", []):
        lines.append(f"  {gpu['name']} ({gpu['memory_gib']} GiB), planner: {gpu['planner_catalogue'] or 'unknown'}")
    ops = report["deepspeed_ops_compiled"]
    if ops:
        lines.append("DeepSpeed ops compiled: " + ", ".join(f"{op} {'yes' if ok else 'no'}" for op, ok in ops.items()))
    else:
        lines.append("DeepSpeed ops: TORCH_EXTENSIONS_DIR is not set; ops compile into ~/.cache on first use")
    lines.append(f"hub: {'offline (HF_HUB_OFFLINE=1)' if report['hub_offline'] else 'online'}")
    if report["missing"]:
        lines.append("missing: " + ", ".join(report["missing"]) + " (pip install -e .)")
    return "\n".join(lines)
