"""Plan the matrix (cells) and run one cell. Shared by the pytest plugin and the CLI.

Models are built once per cell group (model x backend x dtype) and kept for the group's checks; the last
group is cached per process, which suits pytest's in-order run and xdist's ``--dist loadscope`` (one collector per group).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..analysis.fidelity import stand_in_differs
from ..analysis.verdict_rules import unbacked_pass
from ..backends import (
    FLASH_FAMILY,
    VARLEN_CONTRACT,
    FlashBoundariesError,
    KernelArgumentError,
    backend_availability,
    ensure_registered,
)
from ..checks.registry import MODEL_LEVEL_CHECKS, SPECS
from ..checks.workbench import Workbench
from ..model import batches as B
from ..model.build import build_model
from ..model.build_errors import LibraryConfigError, OverrideConfigError, ShrinkError, WeightsError
from ..model.multimodal import position_layout
from ..model.needs_inputs import needed_inputs
from ..model.resolve import ResolvedModel
from ..model.twin import unshrunk_forward_reproduces
from ..results.schema import CellResult, CheckResult


@dataclass(frozen=True)
class Cell:
    """One planned cell. ``backend`` is None for model-level checks (collate)."""

    model_index: int
    label: str
    backend: str | None
    check: str
    dtype: str
    env: str | None = None  # version environment label (envs.VersionCombo.label); None: this environment
    stack: str | None = None  # the stack element applied (model/stack.py; its name ends ``label``); None: the bare model

    @property
    def base_id(self) -> str:
        """The id without the environment: what the run inside a version environment calls this cell."""
        parts = [self.label, self.backend, self.check, self.dtype]
        return "-".join(p for p in parts if p)

    @property
    def cell_id(self) -> str:
        return self.base_id + (f"@{self.env}" if self.env else "")

    @property
    def group(self) -> str:
        """xdist group: a model here; a whole environment (one subprocess run) for version cells."""
        return f"env:{self.env}" if self.env else self.label


def plan_cells(models: list[ResolvedModel], backends: tuple[str, ...], checks: tuple[str, ...], dtypes: tuple[str, ...],
               env: str | None = None, stack: tuple[str, ...] = ()) -> list[Cell]:
    """Cells in run order: model-major, then stack element, dtype, backend, check (so each model is built once per
    backend and element). ``stack``: the elements (``--packcheck-stack``), each its own cells labelled
    ``<model>+<element>``; () the bare models only."""
    cells = []
    for i, m in enumerate(models):
        for element in stack or (None,):
            label = f"{m.spec.label}+{element}" if element else m.spec.label
            for dtype in dtypes:
                for check in checks:
                    if check in MODEL_LEVEL_CHECKS:
                        cells.append(Cell(i, label, None, check, dtype, env, element))
                for backend in backends:
                    for check in checks:
                        if check not in MODEL_LEVEL_CHECKS and backend not in SPECS[check].skip_backends:
                            cells.append(Cell(i, label, backend, check, dtype, env, element))
    return cells


# Errors with which transformers refuses a backend or packing explicitly: "unsupported" cells, not crashes.
# Matched case-insensitively (transformers <= 4.53 writes "does not support Flash Attention 2.0 yet").
_UNSUPPORTED_MARKERS = (
    "does not support an attention implementation",
    "does not support flash attention",
    "does not support flex",
    "does not support `",
    "can't keep packed sequences apart",
    "is not supported",
    "cannot be run on CPU",  # gpt_oss on flex_attention: "Attention sinks cannot be run on CPU with flex attention"
    "shared_kv_states cannot be None",  # gemma4 assistant models run only beside their target model (5.24)
)


#: Errors with which a model says that an optional package its config asks for is missing (``skipped`` cells that
#: name it, as an ImportError's message does): marker (matched in a ValueError's text) -> the distributions.
#: jamba (transformers 4.44 .. 4.57) and zamba (4.46 .. 5.5): the default config's ``use_mamba_kernels=True``
#: selects the fast path, which raises "Fast Mamba kernels are not available" without mamba-ssm and
#: causal-conv1d (and a CUDA device); transformers 5.x picks the PyTorch path by itself.
MISSING_PACKAGE_MARKERS = {"Fast Mamba kernels are not available": ("mamba-ssm", "causal-conv1d")}


def missing_packages(exc: BaseException) -> tuple[str, ...]:
    """The distributions a ValueError of :data:`MISSING_PACKAGE_MARKERS` names as missing; () for any other."""
    if not isinstance(exc, ValueError):
        return ()
    return next((pkgs for marker, pkgs in MISSING_PACKAGE_MARKERS.items() if marker in str(exc)), ())


#: Refusals that name stateful layers: the model cannot keep packed examples apart (transformers' mamba /
#: causal_conv1d paths raise these for packed rows).
STATEFUL_REFUSALS = ("causal_conv1d", "can't keep packed sequences apart")


def stacked_record(record: dict[str, Any], element: str | None) -> dict[str, Any]:
    """A cell's model record with its stack element: ``label`` ``<model>+<element>`` (the report's row, the cell
    id's first part) and ``stack`` the element's name; ``record`` itself when there is none."""
    return {**record, "label": f"{record['label']}+{element}", "stack": element} if element else record


class ResolveError(RuntimeError):
    """The model's config could not be resolved or built (carries the verdict: error or unsupported)."""

    def __init__(self, message: str, status: str = "error", cause: str | None = None) -> None:
        super().__init__(message)
        self.status, self.cause = status, cause


def _classify_exception(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ResolveError):
        return exc.status
    if _is_oom(exc):
        return "oom"
    if isinstance(exc, ImportError) or missing_packages(exc):
        return "skipped"
    if isinstance(exc, (ValueError, NotImplementedError)) and any(m.lower() in text.lower() for m in _UNSUPPORTED_MARKERS):
        return "unsupported"
    if isinstance(exc, TypeError) and NO_POSITION_IDS in text:
        return "unsupported"
    return "error"


#: What Python's TypeError says when the model's forward has no ``position_ids`` parameter (bart, whisper, ... as
#: ``*ForCausalLM`` before transformers 5.0; opt before 4.46): a packed row's restarting positions cannot be given
#: to it, whatever its config. Cause ``no_position_ids``; it was filed as ``library_config`` (issue 41).
NO_POSITION_IDS = "unexpected keyword argument 'position_ids'"


def missing_package_message(stage: str, packages: tuple[str, ...] | list[str], exception: str) -> str:
    """The message of a cell skipped for :func:`missing_packages` (``exception``: ``"ValueError: ..."``)."""
    return f"{'model build: ' if stage == 'build' else ''}missing package {' / '.join(packages)} (not installed here): {exception}"


def _is_oom(exc: BaseException) -> bool:
    """MemoryError (host) or torch's OutOfMemoryError (CUDA, a RuntimeError subclass since torch 2.1)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):  # torch's CPU allocator (a RuntimeError)
        return True
    try:
        import torch

        return isinstance(exc, torch.OutOfMemoryError)
    except (ImportError, AttributeError):
        return "out of memory" in str(exc).lower()


def memory_figures(device: str) -> dict[str, float]:
    """Memory at the time of an OOM, in MiB: peak host RSS of this process; on CUDA, peak allocated, reserved,
    and free / total on the device (torch.cuda.mem_get_info)."""
    import resource

    figures: dict[str, float] = {"host_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            figures.update({"cuda_peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                            "cuda_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
                            "cuda_free_mib": round(free / 2**20, 1), "cuda_total_mib": round(total / 2**20, 1)})
    return figures


def _recover_from_oom(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _fidelity(result: CheckResult, bench: Workbench, cell: Cell) -> CheckResult:
    """A stand-in cell whose model (or TRL, for the SFT checks) branches on the flash_attention_2 name is not a
    verdict on FlashAttention-2 (:mod:`fidelity`): "not checked: differs from real FA2 because ...", with the
    stand-in's own measurement kept in the evidence."""
    if result.status not in ("pass", "fail", "fallback", "error") or result.cause in ("packcheck_error", "library_config"):
        return result
    branches = stand_in_differs(bench.model, cell.backend, with_trl="trl" in SPECS[cell.check].requires)
    if not branches:
        return result
    more = f" (+{len(branches) - 1} more)" if len(branches) > 1 else ""
    return CheckResult("skipped", {**result.metrics, "stand_in_branches": branches[:8]}, (
        f"not checked: differs from real FA2 because {branches[0]}{more} branches on the backend's name, so under "
        f"{cell.backend} the non-flash side runs; the stand-in measured {result.status}: {result.message[:160]}"),
        cause="stand_in_differs", evidence={"branches": branches[:8], "measured_status": result.status,
                                            "measured_cause": result.cause})


#: pytest_packcheck's own folder (this module is in its ``run/``): a crash whose frames are all here is packcheck's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_frame(path: str) -> bool:
    """A frame that does not make a crash the model's: packcheck's own, torch's or the standard library's."""
    from ..errors import is_stdlib_file, package_dirs

    return path.startswith((os.path.join(_PACKAGE_DIR, ""), *package_dirs(("torch",)))) or is_stdlib_file(path)


#: A forward's signature refusing a call (Python raises it while binding, before any frame of the forward runs, so
#: the traceback holds only torch's ``_call_impl``): "BartForCausalLM.forward() got an unexpected keyword argument
#: 'position_ids'" on transformers 4.44, whose Bart / OPT / Whisper decoders take no position_ids.
_SIGNATURE_REFUSAL = re.compile(r"[\w.]+\.forward\(\) (got an unexpected keyword argument|missing \d+ required)")


#: Errors of the code's own shape, which no config size explains: a call that a signature refuses
#: ("_flash_attention_forward() got an unexpected keyword argument 'num_items_in_batch'" in transformers 4.47's
#: flash path; BLOOM's "Got unexpected arguments") and a name read before any branch bound it (4.47's Gemma2 flash
#: path reads ``seq_len`` only bound when an attention_mask is given: a padding-free row has none).
_CODE_SHAPE = re.compile(r"(got an unexpected keyword argument|[Gg]ot unexpected arguments|missing \d+ required "
                         r"(positional|keyword-only) argument|got multiple values for (keyword )?argument)")


def size_independent_crash(exc: BaseException) -> str | None:
    """Why a crash in the model's (or its library's) code is that code's own whatever size packcheck shrank the
    config to, or None: an ``UnboundLocalError`` / ``NameError``, or a refused call (:data:`_CODE_SHAPE`), raised
    in a frame that is not packcheck's, torch's or the standard library's. Such a crash is the library's
    (``crash``), never ``shrunk_crash``."""
    if exc.__traceback__ is None:
        return None
    if isinstance(exc, TypeError) and _SIGNATURE_REFUSAL.match(str(exc)):
        # the model's forward refused the call as packcheck made it, which mirrors Trainer (num_items_in_batch where
        # Trainer's model_accepts_loss_kwargs hands it over: 4.52's OpenLlamaForCausalLM has no **kwargs for it)
        return f"a call its own signature refuses, at {str(exc).split('(', 1)[0]}"
    if isinstance(exc, (UnboundLocalError, NameError)):
        kind = "a name read before the code bound it"
    elif isinstance(exc, (TypeError, ValueError)) and _CODE_SHAPE.search(str(exc)):
        kind = "a call its own signature refuses"
    else:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    callers = [f for f in frames if not _library_frame(os.path.abspath(f.filename))]
    if not callers or (callers[-1] is not frames[-1] and not isinstance(exc, TypeError)):
        # raised in packcheck, torch or the stdlib: only a refused call is the model's, made by its deepest frame
        return None
    where = callers[-1]
    return f"{kind}, at {os.path.basename(where.filename)}:{where.lineno} in {where.name}"


def own_fault(exc: BaseException) -> list[str] | None:
    """The traceback of a crash in packcheck's own code, or None when the model's code took part.

    Own: every frame from the check down to the raise is in pytest_packcheck, torch or the standard library (no
    frame of transformers, TRL, accelerate, a model's remote code or a planted model), and the deepest frame
    that is not torch's or the standard library's is packcheck's: e.g. ``max()`` over the empty second
    micro-batch that ``--packcheck-lengths 8,3`` gave loss_parity before 0.x (issue 23.5). Such a crash is
    packcheck's bug, never the model's (``shrunk_crash``). Returns the formatted frames (file:line in function),
    innermost last."""
    import os

    if isinstance(exc, TypeError) and _SIGNATURE_REFUSAL.match(str(exc)):
        return None  # the model's forward refused the call's arguments (no frame of its own is made): the model's
    # the first frame is the one that caught the exception (the runner's): what ran below it decides
    frames = traceback.extract_tb(exc.__traceback__)[1:] if exc.__traceback__ is not None else []
    if not frames:
        return None
    own_dir = os.path.join(_PACKAGE_DIR, "")
    paths = [os.path.abspath(f.filename) for f in frames]
    if not all(_library_frame(p) for p in paths):
        return None
    if not any(p.startswith(own_dir) for p in paths):  # then the deepest frame not torch's / the stdlib's is ours
        return None
    return [f"{os.path.relpath(f.filename, os.path.dirname(own_dir[:-1]))}:{f.lineno} in {f.name}" for f in frames]


@contextlib.contextmanager
def _no_compile_on_cpu(backend: str | None, device: str) -> Iterator[None]:
    """flex_attention on CPU: run torch's flex_attention and create_block_mask without inductor.

    transformers compiles both; on CPU, inductor compiles C++ for every new shape and head size (20-25 s per
    model, measured here with torch 2.13.0+cpu), which would make an audit of 26 architectures take 20 minutes.
    Uncompiled, torch runs its own flex reference on the same BlockMask built from the same mask_mod by
    transformers' masking code, so the packing plumbing under test is unchanged; only the fused kernel is not.
    """
    if backend != "flex_attention" or device.startswith("cuda"):
        yield
        return
    import transformers.integrations.flex_attention as flex_integration
    from torch.nn.attention.flex_attention import flex_attention

    try:  # 4.53+: masks are built in masking_utils; before, in the flex integration (create_block_causal_mask_flex)
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    mask_owner, mask_name = ((masking_utils, "create_block_mask") if masking_utils is not None
                             else (flex_integration, "create_block_causal_mask_flex"))
    compiled = flex_integration.compile_friendly_flex_attention
    block_mask = getattr(mask_owner, mask_name)

    def eager_flex_attention(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    def eager_block_mask(*args, **kwargs):
        kwargs["_compile"] = False
        return block_mask(*args, **kwargs)

    import torch.nn.attention.flex_attention as torch_flex

    flex_integration.compile_friendly_flex_attention = eager_flex_attention
    setattr(mask_owner, mask_name, eager_block_mask)
    # torch's documented switch for running flex_attention's higher-order op without dynamo (forward only,
    # which is all CPU offers): no tracing per shape. Parity against per-example runs still checks the result.
    debug_flag = torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug_flag
        flex_integration.compile_friendly_flex_attention = compiled
        setattr(mask_owner, mask_name, block_mask)


def text_config(config: Any) -> Any:
    """The config the text path reads (vocab_size, pad_token_id, sliding window): a composite model's text
    sub-config (gemma3, fuyu: no vocab_size at the top level), else ``config`` itself."""
    if getattr(config, "vocab_size", None) is None and hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)
        if getattr(text, "vocab_size", None) is not None:
            return text
    return config


def _no_pass_on_non_finite(check: str, result: CheckResult) -> CheckResult:
    """A pass whose key number is NaN or infinite is no pass (:func:`analysis.verdict_rules.unbacked_pass`): every
    ``x > tolerance`` comparison is False for NaN, so a check that forgot to test finiteness would pass on it
    (gemma3n's grad_parity on the varlen reference did). Such a cell becomes an error with cause ``non_finite``;
    the number is kept."""
    unbacked = unbacked_pass(check, result.status, result.metrics)
    if unbacked is None:
        return result
    key, value = unbacked
    return CheckResult("error", result.metrics, f"{key} is {value}: a pass cannot rest on a non-finite "
                       f"number ({result.message})", cause="non_finite", evidence={key: str(value)})


class CellRunner:
    """Runs cells, keeping the last built model (per group) and the tolerances per dtype."""

    def __init__(self, models: list[ResolvedModel], tolerances: dict[str, dict[str, float]], weights: str = "random",
                 device: str = "cpu", trust_remote_code: bool = False, lengths: tuple[int, ...] | None = None,
                 sliding_window: int | None = None) -> None:
        self.models = models
        self.lengths = tuple(lengths) if lengths else None  # example lengths of the packed row (None: batches.DEFAULT_LENGTHS)
        self.sliding_window = sliding_window  # window the shrink shortens a longer one to (None: models.TINY_SLIDING_WINDOW)
        #: (model index, exception type, message without numbers) -> why the unshrunk config shares the crash, or None
        self._unshrunk_cache: dict[tuple[Any, str, str], str | None] = {}
        self.tolerances = tolerances
        self.weights = weights
        self.device = device
        self.trust_remote_code = trust_remote_code
        self._key: tuple | None = None
        self._bench: Workbench | BaseException | None = None

    def workbench(self, cell: Cell) -> Workbench:
        """Build (or reuse) the model of the cell's group. Raises what the build raised, every time."""
        resolved = self.models[cell.model_index]
        backend = cell.backend or "eager"
        key = (cell.model_index, backend, cell.dtype, cell.stack)
        if key != self._key:
            self._key, self._bench = key, None
            try:
                if resolved.error:
                    raise ResolveError(resolved.error, resolved.error_status, resolved.error_cause)
                ensure_registered(backend)
                model = build_model(resolved, backend, cell.dtype, self.weights, self.device, trust_remote_code=self.trust_remote_code,
                                    sliding_window=self.sliding_window)
                config = text_config(model.config)
                if cell.stack:  # the element on the built model (skipped / unsupported cells name why it cannot run)
                    from ..model.stack import StackUnavailable, apply_element

                    try:
                        model = apply_element(model, cell.stack, cell.backend)
                    except StackUnavailable as exc:
                        raise ResolveError(str(exc), exc.status) from exc
                self._bench = Workbench(model=model, config=config, backend=cell.backend, dtype=cell.dtype,
                                        tol=self.tolerances[cell.dtype], device=self.device,
                                        examples=B.make_examples(config, self.lengths) if self.lengths else [],
                                        layout=position_layout(model, resolved), share_counted_forward=True)
            except Exception as exc:  # noqa: BLE001 - remembered: every cell of the group reports the build failure
                self._bench = exc
        if isinstance(self._bench, BaseException):
            raise self._bench
        bench = self._bench
        assert bench is not None
        bench.backend = cell.backend
        return bench

    def run(self, cell: Cell) -> CellResult:
        """Run one cell; never raises for a model or backend problem (those become the cell's verdict)."""
        resolved = self.models[cell.model_index]
        t0 = time.perf_counter()
        result = _no_pass_on_non_finite(cell.check, self._run(cell))
        counts = getattr(getattr(self._bench, "model", None), "packcheck_weights", None)
        own = self._key == (cell.model_index, cell.backend or "eager", cell.dtype, cell.stack)
        if counts and own:
            result.metrics = {**result.metrics, "weights": counts}  # what --packcheck-weights=pretrained loaded
        if cell.stack and own:  # the element, its library's version and settings (compile: dynamo's graph counts)
            from ..model.stack import stack_record

            record = stack_record(getattr(self._bench, "model", None))
            if record:
                result.metrics = {**result.metrics, "stack": record}
        layout = getattr(self._bench, "layout", None)
        if layout is not None and layout.source and own:
            result.metrics = {**result.metrics, "text_path": layout.describe()}  # M-RoPE rows the checks fed
        return CellResult(
            cell_id=cell.cell_id,
            model=stacked_record(resolved.record(self.weights), cell.stack),
            backend=cell.backend,
            check=cell.check,
            dtype=cell.dtype,
            status=result.status,
            metrics=result.metrics,
            message=result.message,
            duration_s=round(time.perf_counter() - t0, 4),
            tolerances=self.tolerances.get(cell.dtype, {}),
            cause=result.cause,
            evidence=result.evidence,
            findings=result.findings,
            causes=result.causes,
            stack=cell.stack,
        )

    def _run(self, cell: Cell) -> CheckResult:
        try:
            if cell.backend is not None:
                avail = backend_availability(cell.backend, self.device)
                if not avail.available:
                    return CheckResult(avail.status, {}, f"{cell.backend} {avail.reason}")
            bench = self.workbench(cell)
        except KeyError as exc:
            if cell.backend is not None and exc.args and exc.args[0] == cell.backend:
                # e.g. falcon on 5.17: FALCON_ATTENTION_CLASSES[config._attn_implementation], a fixed dict
                return CheckResult("unsupported", {"stage": "build", "exception": _short(exc)}, (
                    f"model build: the model picks its attention class from a fixed table by name (KeyError: "
                    f"'{cell.backend}'): backends registered through AttentionInterface are not supported"))
            return self._failed("build", exc)
        except Exception as exc:  # noqa: BLE001 - a broken model or backend is a cell, not a crash
            return self._failed("build", exc)
        spec = SPECS[cell.check]
        if spec.key_metric and cell.backend is not None:
            # NaN is non_finite on every check that measures numbers (issue 42: NaN logits passed edge_lengths and
            # causality at 0.00e+00 and sent the traps to wrong_positions): decided once, from the cached forward
            with _no_compile_on_cpu(cell.backend, self.device):
                bad = bench.non_finite()
            if bad:
                n = bad["non_finite_logits"]
                return CheckResult("error", bad, (
                    f"the model computes non-finite logits (NaN / +inf: {n['packed']} of {bad['logits']} on the packed row, "
                    f"{n['solo']} on the examples alone): no comparison is possible, nothing passes"),
                    cause="non_finite", evidence=bad)
        try:
            with _no_compile_on_cpu(cell.backend, self.device):
                result = spec.load()(bench)
        except Exception as exc:  # noqa: BLE001 - a crashing check is an error cell
            # a crash under a name branch is the branch's too (opt on 4.57.1: its non-FA2 side builds a 4-D mask
            # that the flash path's unpad then indexes out of range)
            return _fidelity(self._failed("check", exc), bench, cell)
        return _fidelity(result, bench, cell)

    def _user_overrides(self) -> str:
        """The config values the user set on the current model (its spec's ``{key=value}``, into which
        ``--packcheck-config`` is folded by :func:`config.settings.resolve`), as typed; "" when none."""
        from ..model.specs import format_overrides

        index = self._key[0] if self._key else None
        if index is None or not 0 <= index < len(self.models):
            return ""
        own = tuple(self.models[index].spec.overrides or ())
        return format_overrides(own) if own else ""

    def _unshrunk_reproduces(self, exc: BaseException) -> str | None:
        """:func:`unshrunk_forward_reproduces` for the current model, once per model and error (a model that
        crashes in every check builds its full-size meta twin once)."""
        from ..model.twin import normalised_error as _normalised

        key = (self._key[0] if self._key else None, type(exc).__name__, _normalised(str(exc)))
        if key[0] is None or not 0 <= key[0] < len(self.models):
            return None
        if key not in self._unshrunk_cache:
            self._unshrunk_cache[key] = unshrunk_forward_reproduces(self.models[key[0]], exc, self.trust_remote_code)
        return self._unshrunk_cache[key]

    def _failed(self, stage: str, exc: BaseException) -> CheckResult:
        status = _classify_exception(exc)
        metrics: dict[str, object] = {"stage": stage, "exception": _short(exc)}
        if exc.__traceback__ is not None:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            metrics["where"] = f"{where.name}:{where.lineno}"
        if status == "oom":
            metrics.update(memory_figures(self.device))
            if stage == "build":
                self._key, self._bench = None, None  # do not keep a half-built model; the next cell retries
            _recover_from_oom(self.device)
            figures = ", ".join(f"{k} {v}" for k, v in metrics.items() if k.endswith("_mib"))
            return CheckResult("oom", metrics, f"out of memory in {stage}: {_short(exc)} ({figures})")
        packages = missing_packages(exc)
        if packages:  # an optional package the config asks for: named, as an ImportError names it
            return CheckResult("skipped", {**metrics, "missing": list(packages)}, missing_package_message(stage, packages, _short(exc)))
        cause = None
        if status == "unsupported" and any(m in str(exc) for m in STATEFUL_REFUSALS):
            cause = "stateful_layers_refused"
        elif status == "unsupported" and NO_POSITION_IDS in str(exc):
            cause = "no_position_ids"
        backend = self._key[1] if self._key else None
        if isinstance(exc, NameError) and backend in FLASH_FAMILY and "flash" in (exc.name or str(exc)):
            # falcon (5.24) imports _flash_attention_forward only when flash-attn is installed, and calls it for
            # every flash-family backend: the backend cannot be loaded without flash-attn, whatever its kernel
            return CheckResult("skipped", metrics, (
                f"cannot load this backend: the model imports {exc.name or 'its flash path'} only when flash-attn is "
                f"installed ({_short(exc)})"))
        if isinstance(exc, FlashBoundariesError):  # the model's own flash path, not a crash: a verdict
            return CheckResult("fail", {**metrics, "cu_seqlens": exc.boundaries, "tokens": exc.total}, (
                f"the flash path handed the varlen kernel {exc.name}="
                f"{exc.boundaries if len(exc.boundaries) <= 12 else [*exc.boundaries[:11], '...', exc.boundaries[-1]]} for a row of "
                f"{exc.total} tokens: FlashAttention-2 would read outside the row"),
                cause="flash_boundaries", evidence={"cu_seqlens": exc.boundaries, "tokens": exc.total})
        own = own_fault(exc) if status == "error" and not isinstance(exc, (ResolveError, ShrinkError, LibraryConfigError, OverrideConfigError, WeightsError)) else None
        # (a WeightsError is packcheck refusing the user's weights on purpose, not a crash of its code: its message stands)
        if own:  # packcheck's own probe code crashed, with no frame of the model or its libraries: packcheck's bug
            return CheckResult(status, {**metrics, "traceback": own}, (
                f"packcheck's own code crashed in {stage} ({metrics.get('where')}), not the model: {_short(exc)}; "
                "this check judged nothing, report it to packcheck with the traceback in the details"),
                cause="packcheck_error", evidence={"exception": _short(exc), "stage": stage, "traceback": own})
        if isinstance(exc, KernelArgumentError):  # the model's flash path broke the kernels' contract: a verdict
            return CheckResult("fail", {**metrics, "item": exc.item, "received": exc.received}, (
                f"the flash path handed the varlen kernel {exc.item}: {exc.received}; the kernels require "
                f"{VARLEN_CONTRACT[exc.item][0]} ({VARLEN_CONTRACT[exc.item][1]})"),
                cause="kernel_arguments", evidence={"item": exc.item, "received": exc.received})
        if status == "error" and self.weights == "random" and not isinstance(exc, (ResolveError, ShrinkError, LibraryConfigError, OverrideConfigError)):
            text = f"model build: {_short(exc)}" if stage == "build" else _short(exc)
            why = self._unshrunk_reproduces(exc)
            needs = needed_inputs(self.models[self._key[0]].model_type, str(exc)) if why and self._key else None
            if needs:  # the model's training forward takes inputs of another form: its input contract, not its config
                return CheckResult("unsupported", metrics, (
                    f"needs inputs packcheck does not give: {needs.inputs} ({needs.why}): {text}"),
                    cause="needs_inputs", evidence={"exception": _short(exc), "stage": stage, "unshrunk": why,
                                                    "inputs": needs.inputs})
            if why:  # the unshrunk config fails too (on the meta device): the library's config, not the shrink
                return CheckResult(status, metrics, f"{text} ({why}: not packcheck's shrink)",
                                   cause="library_config", evidence={"exception": _short(exc), "stage": stage, "unshrunk": why})
            code = size_independent_crash(exc)
            if code:  # the library's own code error: no size of the config explains it
                return CheckResult(status, metrics, f"the model's code crashed ({code}; no config size explains it, "
                                   f"not packcheck's shrink): {text}",
                                   cause="crash", evidence={"exception": _short(exc), "stage": stage, "code_error": code})
            overrides = self._user_overrides()
            if overrides:  # the user's own values built this model: they are suspect before packcheck's shrink (issue 42:
                # arch:gpt2{n_positions=4} crashing on a 13-token row was "packcheck's to fix")
                return CheckResult(status, metrics, (
                    f"crashed in the model built with your overrides ({overrides}): {text}; the override is suspect "
                    "before packcheck's shrink or the library"),
                    cause="override_config", evidence={"exception": _short(exc), "stage": stage, "overrides": overrides})
            # the crash happened in the tiny model packcheck made of the config: the full-size model may not crash
            return CheckResult(status, metrics, f"crashed in the model packcheck shrank (random weights): {text}",
                               cause="shrunk_crash", evidence={"exception": _short(exc), "stage": stage})
        if isinstance(exc, ResolveError) and exc.cause:
            cause = exc.cause
        elif isinstance(exc, ShrinkError):
            cause = "shrink_limit"
        elif isinstance(exc, LibraryConfigError):
            cause = exc.cause  # library_config, or crash: the library's model code, whatever its config
        elif isinstance(exc, OverrideConfigError):
            cause = "override_config"
        elif isinstance(exc, WeightsError):
            cause = getattr(exc, "cause", "weights_mismatch")
        if stage == "build":
            text = str(exc) if isinstance(exc, ResolveError | LibraryConfigError | OverrideConfigError | WeightsError) else f"model build: {_short(exc)}"
            return CheckResult(status, metrics, text, cause=cause, evidence={"exception": _short(exc)} if cause else {})
        return CheckResult(status, metrics, _short(exc), cause=cause, evidence={"exception": _short(exc)} if cause else {})
