"""The guard's verdict: :class:`GuardResult` (what one packed row measured, its one line and JSON) and the errors
and warning the guard raises."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import PackcheckError, PackcheckUsageError, PackcheckWarning


def _tol(value: Any) -> str:
    """A tolerance as short as it is exact: 1e-04, 1.5e-02."""
    return f"{value:.1e}".replace(".0e", "e") if isinstance(value, int | float) else str(value)


class PackedBatchMismatch(PackcheckError):
    """The packed row does not train like its examples alone; ``.result`` holds the :class:`GuardResult`."""

    def __init__(self, result: GuardResult) -> None:
        super().__init__(result.line())
        self.result = result


def hide_mismatch_frames(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` for the guard's own frames: hidden when what they raise is a
    :class:`PackedBatchMismatch` (its one-line diagnosis is the report; trial 7, 148: a failing
    ``packcheck_verify`` printed 139 lines of packcheck's source), shown for anything else (a bug of packcheck's)."""
    return bool(excinfo.errisinstance(PackedBatchMismatch))


class PackcheckGuardWarning(PackcheckWarning):
    """A mismatch under ``on_mismatch="warn"``, a silent backend swap, or a batch with nothing to compare."""


def print_line(line: str) -> None:
    """Print the guard's line on its own line of stderr: through ``tqdm.write`` (which clears the live progress
    bars the Trainer's ProgressCallback draws on the same stream, prints, and redraws them), else after a newline."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it no bar can be live
        print(f"\n{line}", file=sys.stderr)
        return
    tqdm.write(line, file=sys.stderr)


def hidden_by_a_blanket_filter(line: str) -> bool:
    """True when the warnings filter that decides a :class:`PackcheckGuardWarning` with this text ignores every
    warning of a broader category, without naming the guard's (``warnings.simplefilter("ignore")``, common in
    training scripts). A filter naming the guard's warning (its class or a subclass), its text (a message regex
    that matches) or a module is the user's say on it and is followed."""
    for action, message, category, module, lineno in warnings.filters:
        if not issubclass(PackcheckGuardWarning, category):
            continue
        if issubclass(category, PackcheckGuardWarning) or module is not None or lineno:
            return False
        if message is not None:
            if message.match(line):
                return False
            continue
        return action == "ignore"
    return False


def say(line: str, stacklevel: int = 1) -> None:
    """Tell the user a guard line that warns: a :class:`PackcheckGuardWarning` (``stacklevel`` as
    ``warnings.warn``'s, counted from the caller), or, where a blanket filter would hide it
    (:func:`hidden_by_a_blanket_filter`), printed on stderr (:func:`print_line`, the guard's verdict channel):
    once either way, never silenced by a filter that does not name the guard."""
    if hidden_by_a_blanket_filter(line):
        print_line(line)
        return
    warnings.warn(line, PackcheckGuardWarning, stacklevel=stacklevel + 1)


class NotPackedError(PackcheckUsageError):
    """The batch is not a packed row (a padded ``(batch, length)`` batch, or one row that nothing marks as packed:
    no position_ids, no cu_seq_lens_q). :class:`PackcheckCallback` reads it as "not packed: nothing to check"
    and lets training go on; :func:`verify_packed_batch` raises it (a :class:`PackcheckUsageError`)."""


@dataclass
class GuardResult:
    """What :func:`verify_packed_batch` measured on one packed row.

    ``verdict``: "pass", "fail", "fallback" (numbers agree but attention ran on another backend than
    requested) or "skipped" (nothing judged: one example in the row, no labelled token, or a batch that is not
    packed; ``evidence`` says which). ``cause``: a code of :data:`pytest_packcheck.analysis.diagnose.CAUSES` (None on a
    pass) and ``remedy`` its one-line fix; ``causes``: every code found, ``cause`` first (a broken batch contract adds
    its items' codes). ``also``: each measured cause beside a broken batch contract that does not account for the
    numbers (an empty example on sdpa and a leak), as ``{"cause", "evidence", "remedy"}``, in ``causes`` too.
    ``dtype``: the tolerance row, from how the forward computed (``dtype_source``, e.g. "autocast bfloat16
    over float32 weights").
    ``max_logprob_diff``: the worst absolute difference (nats) of a labelled token's log-prob, packed vs its
    example alone; ``loss_*``: the token-mean negative log-likelihood (nats) over the labelled tokens.
    ``tolerance``: the dtype's ``logits_atol`` (log-probs) and ``loss_atol`` (loss). ``probes``: the reruns
    that named the cause. ``forwards``: model forwards the check ran; ``duration_s``: its wall time (seconds).
    ``label_tokens``: the row's labelled next-token targets the reference scores (none across an example start),
    counted also where nothing is compared (one example in the row); 0 before the row could be split.
    On an encoder or embedding model (``compared`` "logit" / "hidden-state", :mod:`.encoder`) ``max_logprob_diff``
    is the worst absolute difference of its per-token outputs (the head's logits, else ``last_hidden_state``) and of
    its mean / CLS / last-token embeddings per segment (``probes["pooled"]``), ``loss_*`` the masked-LM /
    token-classification loss in nats per labelled token (labels unshifted), ``label_tokens`` those labels.
    """

    verdict: str
    cause: str | None
    remedy: str
    evidence: str
    dtype: str
    tolerance: dict[str, float]
    max_logprob_diff: float | None
    per_example_logprob_diff: list[float]
    loss_packed: float | None
    loss_reference: float | None
    loss_delta: float | None
    lengths: list[int]
    label_tokens: int
    contract: list[str]
    run: dict[str, Any]
    attention: dict[str, Any]
    probes: dict[str, Any] = field(default_factory=dict)
    fallback: str | None = None
    forwards: int = 0
    duration_s: float = 0.0
    versions: dict[str, Any] = field(default_factory=dict)
    dtype_source: str = ""
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    also: list[dict[str, str]] = field(default_factory=list)
    #: what ``max_logprob_diff`` and ``per_example_logprob_diff`` measure: "log-prob" (a causal LM: nats), "logit" or
    #: "hidden-state" (an encoder's per-token outputs and pooled embeddings, :mod:`.encoder`: absolute differences)
    compared: str = "log-prob"

    @property
    def ok(self) -> bool:
        """True unless the packed row trains differently from its examples (a pass, a fallback or a skip)."""
        return self.verdict != "fail"

    def line(self) -> str:
        """One line: verdict, worst difference and its tolerance, cause and remedy; for a batch that is not packed
        (:class:`PackcheckCallback` on a padded run), that nothing was checked and that training goes on. Scrubbed
        here, once, for every reader (the stderr line, the warning, PackedBatchMismatch): the evidence may quote the
        model's own error text (issue 42: a token in it was printed in clear)."""
        from ..errors import scrub_secrets

        return scrub_secrets(self._line())

    def _line(self) -> str:
        if self.run.get("packed") is False:
            return f"packcheck guard: {self.evidence}; training goes on unchanged"
        worst = "n/a" if self.max_logprob_diff is None else f"{self.max_logprob_diff:.2e}"
        loss = "n/a" if self.loss_delta is None else f"{self.loss_delta:.2e}"
        verdict = "SKIPPED (nothing judged)" if self.verdict == "skipped" else self.verdict.upper()
        dtype = f"{self.dtype} ({self.dtype_source})" if self.dtype_source and self.dtype_source != f"{self.dtype} weights" else self.dtype
        head = (f"packcheck guard: {verdict} on {len(self.lengths)} packed examples ({sum(self.lengths)} tokens, "
                f"{dtype}, {self.run.get('attn_implementation')}): worst {self.compared} diff {worst} "
                f"(tol {_tol(self.tolerance.get('logits_atol'))}), loss diff {loss} (tol {_tol(self.tolerance.get('loss_atol'))})")
        if self.cause:
            head += f"; cause {self.cause}: {self.evidence}; remedy: {self.remedy}"
            for more in self.also:
                head += f"; and cause {more['cause']}: {more['evidence']}; remedy: {more['remedy']}"
        elif self.evidence:
            head += f"; {self.evidence}"
        if self.notes:
            head += "; note: " + "; ".join(self.notes)
        if self.fallback:
            head += f"; fallback: {self.fallback}"
        return head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """The result as JSON, scrubbed (``packcheck-guard.json``): an exception text in ``evidence`` may carry a token
        (issue 42: the model's own error message was written in clear)."""
        from ..errors import scrub_secrets

        return scrub_secrets(json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str))


def _usage(message: str) -> PackcheckUsageError:
    return PackcheckUsageError(f"verify_packed_batch: {message}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"
