"""The one table of the atlas's library axes (:data:`LIBRARY_AXES`): what ``packcheck lookup``'s ``--verl`` /
``--openrlhf`` / ``--ms-swift`` / ``--unsloth`` / ``--peft`` / ``--accelerate`` (and ``--trl X --stack E``) answer from, kept apart from
:mod:`.library_axes` (the block and the answer) so that building lookup's parser compiles a few lines only (issue 47:
a fresh process compiles every module it imports)."""

from __future__ import annotations


class LibraryAxis:
    """One library axis. ``library``: the pip name, also the lookup flag (``--verl``, ``--ms-swift``) and the key of
    ``support.json["axes"]["axes"]``; ``kind``: ``rl_trainer`` (the trainer's own packed log-prob path on
    ``families`` x ``backends``; one element, the path) or ``stack`` (stack elements through Trainer / SFTTrainer on
    ``arch:llama`` ``sdpa``; ``--stack ELEMENT``); ``source`` / ``key``: the committed file under ``reports/atlas`` and
    the key of the axis in it (``trainers[key]`` / ``axes[key]``); ``check``: the check that measured it; ``number``:
    its key number's name and unit; ``reproduce``: the command that measures one release again (``{release}``)."""

    __slots__ = ("check", "key", "kind", "library", "number", "reproduce", "source")  # a plain class: no NamedTuple /
    # dataclass machinery at lookup's start-up

    def __init__(self, library: str, kind: str, source: str, key: str, check: str, number: str, reproduce: str) -> None:
        self.library, self.kind, self.source, self.key = library, kind, source, key
        self.check, self.number, self.reproduce = check, number, reproduce

    def __repr__(self) -> str:
        return f"LibraryAxis({self.library!r}, {self.kind!r}, {self.source!r})"


#: Every library axis lookup answers, by library (the flag ``--<library>``). TRL's stack axis is asked as
#: ``--trl X --stack ELEMENT`` (``--trl X`` alone answers SFTTrainer's and the RL trainers' TRL axis, ``trl.json``).
LIBRARY_AXES: dict[str, LibraryAxis] = {a.library: a for a in (
    LibraryAxis("verl", "rl_trainer", "rl_peers.json", "verl", "rl_verl_rmpad", "Δlogp (nats per token)",
                "python -m pytest_packcheck.atlas.rl_peers --trainers verl --releases {release}"),
    LibraryAxis("openrlhf", "rl_trainer", "rl_peers.json", "openrlhf", "rl_openrlhf_packed", "Δlogp (nats per token)",
                "python -m pytest_packcheck.atlas.rl_peers --trainers openrlhf --releases {release}"),
    LibraryAxis("ms-swift", "rl_trainer", "rl_peers.json", "ms-swift", "rl_swift_padding_free",
                "Δmargin (nats per pair)", "python -m pytest_packcheck.atlas.rl_peers --trainers ms-swift --releases {release}"),
    LibraryAxis("unsloth", "rl_trainer", "rl_peers.json", "unsloth", "rl_unsloth_grpo_packed", "Δlogp (nats per token)",
                "python -m pytest_packcheck.atlas.rl_peers --trainers unsloth --releases {release}"),
    LibraryAxis("peft", "stack", "stack.json", "peft", "stack_trainers", "logits max |Δ| (float32), loss Δ (nats)",
                "python tools/stack_releases.py --axis peft --releases {release}"),
    LibraryAxis("accelerate", "stack", "stack.json", "accelerate", "stack_trainers", "logits max |Δ| (float32), loss Δ (nats)",
                "python tools/stack_releases.py --axis accelerate --releases {release}"),
    LibraryAxis("trl", "stack", "stack.json", "trl", "stack_trainers", "logits max |Δ| (float32), loss Δ (nats)",
                "python tools/stack_releases.py --axis trl --releases {release}"),
)}
