"""accelerate's context parallelism on two gloo ranks (CPU), and its Ulysses sequence-parallel adapter, as far as
they run without CUDA (issue 45).

:func:`check_cp_ranks` starts two processes (fresh interpreters) that join a gloo process group
(world_size 2) and do what ``Accelerator`` + ``Trainer`` do under ``ParallelismConfig(cp_size=2)``, in order:
the model rebuilt from the cell's config and weights, accelerate's hook attached
(``big_modeling._attach_context_parallel_hooks``), the cp device mesh, ``set_rotate_method`` and
``functools.partial(context_parallel, mesh=...)`` as ``Accelerator._prepare_cp`` builds them
(accelerate 1.16.0 accelerator.py), the packed row's buffers chosen by Trainer's own
``_prepare_context_parallel_inputs`` (input_ids, labels, shift_labels, position_ids), sharded by torch's
``context_parallel``, then the forward. Each rank reports its shard (tokens, position_ids, where they restart) and
the forward's outcome. torch's ring attention has sharding strategies for the CUDA SDPA kernels only: on CPU the
forward raises (torch 2.13.0: ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered``), and the cell is a skip that names it, with the shards
measured. Where the forward runs, the gathered logits are compared with each example alone (``logits_atol``).

The sharding is checked on every machine: the position_ids must be sharded with the row (the same tokens as
input_ids on every rank), or each rank's shard carries another part of the row's positions (planted:
a Trainer whose buffer list leaves position_ids out: ``wrong_positions``).

Ulysses (``ParallelismConfig(sp_backend="deepspeed")``): ``Accelerator`` imports
``deepspeed.runtime.sequence_parallel.ulysses_sp`` (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter); without
deepspeed the verdict names it (:func:`ulysses_availability`).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from ..results import CheckResult
from .workbench import _fmt

WORLD_SIZE = 2
#: Wall seconds the two ranks may take together (each imports torch and transformers and builds the tiny model).
RANK_TIMEOUT_S = 300


def ulysses_availability() -> str | None:
    """Why accelerate's Ulysses adapter cannot run here (deepspeed missing, named with the line of accelerate that
    imports it), or None."""
    from importlib.util import find_spec

    if find_spec("deepspeed") is not None:
        return None
    import accelerate.accelerator as acc

    from .stack_trainers import source_line

    at = source_line(acc, "from deepspeed.runtime.sequence_parallel.ulysses_sp import")
    return (f"accelerate's Ulysses adapter needs deepspeed (not installed here): {at or 'accelerate/accelerator.py'} imports "
            "deepspeed.runtime.sequence_parallel.ulysses_sp (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)")


def _rank(rank: int, work: str, drop_position_ids: bool) -> None:
    """One gloo rank (run in its own interpreter by :func:`run_ranks`). Reads ``work``/model.pt and batch.pt,
    writes ``work``/rank<rank>.json."""
    import functools
    import types

    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"rank": rank}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=WORLD_SIZE)
        from accelerate.big_modeling import _attach_context_parallel_hooks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method
        from transformers import AutoModelForCausalLM
        from transformers.trainer import Trainer

        saved = torch.load(f"{work}/model.pt", weights_only=False)
        model = AutoModelForCausalLM.from_config(saved["config"], attn_implementation="sdpa")
        model.load_state_dict(saved["state"])
        model.eval()
        _attach_context_parallel_hooks(model)
        mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("cp",))
        set_rotate_method("allgather")  # accelerate's default cp_comm_strategy
        cp = functools.partial(context_parallel, mesh=mesh)
        batch = torch.load(f"{work}/batch.pt")
        config = types.SimpleNamespace(cp_enabled=True, cp_backend="torch", sp_backend=None, sp_enabled=False)
        accelerator = types.SimpleNamespace(parallelism_config=config, maybe_context_parallel=cp)
        trainer = types.SimpleNamespace(accelerator=accelerator)
        # the planted fault: a collator or hook that drops position_ids before the trainer (Trainer then makes
        # arange positions over the whole row: "Position IDs not found in the inputs, generating manually")
        inputs = {k: v for k, v in batch.items() if not (drop_position_ids and k == "position_ids")}
        make, inputs = Trainer._prepare_context_parallel_inputs(trainer, model, inputs)
        out["buffers"] = [k for k, v in inputs.items() if hasattr(v, "shape") and k in ("input_ids", "labels", "shift_labels",
                                                                                       "position_ids", "attention_mask")]
        # one more buffer, the row's token index, sharded like the others: which tokens each rank holds
        index = torch.arange(batch["input_ids"].shape[1])[None]
        make = functools.partial(make.func, *make.args, **{**make.keywords, "buffers": [*make.keywords["buffers"], index],
                                                           "buffer_seq_dims": [*make.keywords["buffer_seq_dims"], 1]})
        with make():
            ids, pos = inputs["input_ids"], inputs["position_ids"]
            out["shard_index"] = index[0].tolist()
            out["shard_tokens"] = int(ids.shape[1])
            out["shard_position_ids_len"] = int(pos.shape[-1])
            out["shard_input_ids"] = ids[0].tolist()
            out["shard_position_ids"] = pos[0].tolist()
            try:
                with torch.no_grad():
                    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                (full,) = context_parallel_unshard(mesh, [logits], [1])
                out["forward"] = "ran"
                if rank == 0:
                    torch.save(full, f"{work}/logits.pt")
            except Exception as exc:  # noqa: BLE001 - the forward's refusal is the measurement
                out["forward"] = "raised"
                out["raised"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"
    except Exception as exc:  # noqa: BLE001 - a rank that cannot set up reports why
        out["setup_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"
    finally:
        with open(f"{work}/rank{rank}.json", "w", encoding="utf-8") as fh:
            json.dump(out, fh)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(model: Any, batch: dict[str, Any], drop_position_ids: bool = False) -> list[dict[str, Any]]:
    """Two gloo ranks on ``model`` (its config and weights) and the packed ``batch`` (:func:`_rank`); each rank's
    report. Raises RuntimeError when the processes cannot be started."""
    import subprocess
    import sys

    import torch

    with tempfile.TemporaryDirectory(prefix="packcheck-cp-") as work:
        torch.save({"config": model.config, "state": model.state_dict()}, f"{work}/model.pt")
        torch.save({k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "labels")}, f"{work}/batch.pt")
        # fresh interpreters (not multiprocessing: an audit's cell runs in a daemonic process, which may not have
        # children of its own), one intra-op thread each
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        code = "import sys; from pytest_packcheck.checks.stack_ranks import _rank; _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3] == '1')"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), work, "1" if drop_position_ids else "0"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(WORLD_SIZE)]
        try:
            errors = [p.communicate(timeout=RANK_TIMEOUT_S)[1] for p in procs]
        except subprocess.TimeoutExpired as exc:
            for p in procs:
                p.kill()
            raise RuntimeError(f"the ranks did not finish within {RANK_TIMEOUT_S} s") from exc
        missing = [r for r in range(WORLD_SIZE) if not os.path.exists(f"{work}/rank{r}.json")]
        if missing:
            tail = " ".join((errors[missing[0]] or "").split()[-30:])
            raise RuntimeError(f"rank {missing[0]} exited {procs[missing[0]].returncode} without a report: {tail}")
        reports = []
        for rank in range(WORLD_SIZE):
            with open(f"{work}/rank{rank}.json", encoding="utf-8") as fh:
                reports.append(json.load(fh))
        if all(r.get("forward") == "ran" for r in reports):
            reports[0]["logits"] = torch.load(f"{work}/logits.pt")
        return reports


def row_for_ranks(wb: Any) -> tuple[dict[str, Any], list[list[int]]]:
    """The workbench's packed row, made divisible by 2 x world_size (torch's load-balanced sharding needs it) by one
    more example of pad tokens at the end (labels -100 there, as a collator's pad_to_multiple_of would), and the
    examples it holds."""
    examples = [list(e) for e in wb.examples]
    total = sum(len(e) for e in examples)
    extra = (-total) % (2 * WORLD_SIZE)
    if extra:
        examples.append([wb.pad_id] * extra)
    batch = wb.packed(examples)
    if extra:
        batch["labels"][0, total:] = -100
    return batch, examples


def check_cp_ranks(wb: Any, drop_position_ids: bool = False) -> CheckResult:
    """The ``cp`` element on two gloo ranks (module docstring). pass: the forward ran and every example = alone;
    fail: the shards carry other positions than their tokens (``wrong_positions``) or the gathered logits differ
    from each example alone (``stack_mask_dropped``); skipped: the forward needs CUDA (the exception named, the shards
    measured), or no ``cp`` element on the cell."""
    from .stack import stacked

    model = stacked(wb)
    if model is None or model.element.name != "cp":
        return CheckResult("skipped", {}, "cp_ranks runs on the cp stack element's cells (--packcheck-stack cp)")
    if wb.backend != "sdpa":  # Trainer._prepare_context_parallel_inputs: "supported only with SDPA attention"
        import transformers.trainer as tt

        from .stack_trainers import source_line

        at = source_line(tt, "Context parallelism is supported only with SDPA attention")
        return CheckResult("unsupported", {"refused_at": at}, f"transformers' Trainer refuses context parallelism on "
                           f"{wb.backend} ({at}: sdpa only): cp_ranks runs on the sdpa cells")
    batch, examples = row_for_ranks(wb)
    try:
        reports = run_ranks(model.base, batch, drop_position_ids)
    except Exception as exc:  # noqa: BLE001 - processes that cannot start: the cell says why
        return CheckResult("skipped", {}, f"two gloo ranks could not start here: {type(exc).__name__}: {exc}")
    import torch

    metrics: dict[str, Any] = {"world_size": WORLD_SIZE, "backend": "gloo", "torch": torch.__version__,
                               "row_tokens": int(batch["input_ids"].shape[1]), "ulysses": ulysses_availability() or "available",
                               "ranks": [{k: v for k, v in r.items() if k not in ("logits", "shard_input_ids", "shard_index")}
                                         for r in reports]}
    broken = [r["setup_error"] for r in reports if "setup_error" in r]
    if broken:
        return CheckResult("skipped", metrics, f"two gloo ranks: set-up failed: {broken[0]}")
    metrics["buffers"] = reports[0]["buffers"]
    # the sharding: position_ids must travel with the row (the same tokens on each rank)
    full_pos = batch["position_ids"][0].tolist()
    mismatched = [r["rank"] for r in reports if r["shard_position_ids_len"] != r["shard_tokens"]
                  or [full_pos[i] for i in r["shard_index"]] != r["shard_position_ids"]]
    shards = ", ".join(f"rank {r['rank']}: {r['shard_tokens']} tokens, {r['shard_position_ids_len']} position_ids" for r in reports)
    if mismatched:
        return CheckResult("fail", metrics, f"two gloo ranks: position_ids are not sharded with the row ({shards}; buffers "
                           f"{metrics['buffers']}): each rank reads positions of other tokens", cause="wrong_positions",
                           evidence={"ranks": mismatched, "buffers": metrics["buffers"]})
    if any(r.get("forward") != "ran" for r in reports):
        raised = next(r["raised"] for r in reports if r.get("forward") == "raised")
        metrics["forward"] = raised
        return CheckResult("skipped", metrics, f"two gloo ranks: accelerate's hook attached, Trainer's CP buffers "
                           f"{metrics['buffers']} sharded with the row ({shards}); the forward needs CUDA: torch "
                           f"{torch.__version__}'s context_parallel has ring attention for the CUDA SDPA kernels only ({raised})")
    logits = reports[0]["logits"][0].float()
    starts = [0]
    for e in examples[:-1]:
        starts.append(starts[-1] + len(e))
    real = examples if len(examples) == len(wb.examples) else examples[:-1]
    diff = max(float((logits[s:s + len(e)] - wb.solo(e, model=model.base)).abs().max()) for s, e in zip(starts, real, strict=False))
    metrics["max_abs_diff"] = diff
    if diff <= wb.tol["logits_atol"]:
        return CheckResult("pass", metrics, f"two gloo ranks: every example = alone within {_fmt(diff)} ({shards})")
    return CheckResult("fail", metrics, f"two gloo ranks: the examples differ from each alone by {_fmt(diff)} (accelerate's "
                       "hook drops the packed mask for is_causal=True)", cause="stack_mask_dropped", evidence={"max_abs_diff": diff})

