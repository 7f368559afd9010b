"""What other training tools claim about packing, read from their released wheels (parsed with :mod:`ast`, never
imported: importing them needs their GPU stack), compared with the atlas at the transformers release each pins.

Readers (one per peer, each names the file and line a claim comes from):

- axolotl: ``axolotl/monkeypatch/multipack.py`` ``SUPPORTED_MULTIPACK_MODEL_TYPES`` (sample packing allowed) on the
  attention implementations of ``axolotl/utils/schemas/enums.py`` ``ATTN_IMPLS_SUPPORTING_PACKING`` (the flash
  family and flex; in-tree models run transformers' own position_ids path, per the comment in
  ``patch_for_multipack``); model types whose folder under ``axolotl/monkeypatch/models/`` touches packing
  (``seq_idx``, ``cu_seqlens``, packed rows) rest on axolotl's own modelling patch.
- ms-swift: ``support_padding_free`` class attributes of its templates (``swift/template/``); a template that does
  not set it inherits ``None``, which ``swift/pipelines/train/sft.py`` reads as "yes for every text-only model".
- LLaMA-Factory: ``raise ValueError(... packing ...)`` under an ``if`` that tests a list of model types (its
  refusals); neat_packing runs on its own segment-id mask and ``_get_unpad_data`` patch (``model_utils/packing.py``).
- verl (0.9): remove padding (``use_remove_padding``, default True in ``verl/workers/config/model.py``, on
  ``flash_attention_2`` by default) for every model: the rows are unpadded into one packed row and transformers'
  ``_flash_attention_forward`` is replaced by verl's ``_ulysses_flash_attention_forward``
  (``verl/models/transformers/monkey_patch.py``), which at ulysses_sp_size 1 hands the same arguments on: judged
  on the atlas's flash column. The model types ``apply_monkey_patch`` tests by name get their forward or attention
  replaced by verl's own: they rest on verl's patch.
- unsloth: ``PADDING_FREE_BLOCKLIST`` in ``unsloth/trainer.py`` (padding-free and packing refused); every other
  text model packs, through unsloth's own varlen attention over packed rows (``unsloth/utils/hf_packed_attention.py``)
  and its own model forwards: that claim rests on unsloth's code. Its structural gates (hybrid linear-attention
  models, a forward without ``packed_seq_lengths`` / ``**kwargs``) name no model type and are noted, not listed.

A released package is a wheel or an sdist (:class:`PeerArchive`). A package whose reader does not find the file
(or the literal) it reads becomes a peer entry without claims that names why (:attr:`PeerClaims.reason`).
"""

from __future__ import annotations

import ast
import re
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from ..backends.table import REFERENCE_BACKEND
from ..errors import PackcheckUsageError


@dataclass
class Claim:
    """One claim: ``model_type`` (or ``"*"``: every text-only model) ``supported`` (True: the peer packs it,
    False: it refuses) on ``backends`` (atlas columns it is judged on), from ``file``:``line``; ``own_code``:
    the claim rests on the peer's own patch or kernel (named), so it is not judged against stock transformers."""

    peer: str
    model_type: str
    supported: bool
    backends: tuple[str, ...]
    file: str
    line: int
    own_code: str = ""
    note: str = ""
    #: the source line at ``file``:``line`` as the wheel has it (stripped, at most 120 characters): the statement
    statement: str = ""


@dataclass
class PeerClaims:
    peer: str
    version: str
    transformers_pin: str
    wheel: str
    claims: list[Claim] = field(default_factory=list)
    #: why no claim was read (the file or literal the reader needs is not in this release), "" when read
    reason: str = ""


class UnreadablePeer(Exception):
    """The peer's package lacks what its reader reads (a file, a literal): the message says which."""


#: The largest unpacked member of a peer's package claims reads (a source file is kilobytes; 16 MB is generous).
MAX_MEMBER_BYTES = 16 * 1024 * 1024


class PeerArchive:
    """A peer's released package opened for reading, never imported: a wheel (zip) or an sdist (``.tar.gz`` /
    ``.zip`` with a ``PKG-INFO``). Members are named as in the wheel (``axolotl/monkeypatch/multipack.py``): an
    sdist's top folder (and a ``src/`` layout) is stripped. :meth:`read` of a member that is not there raises
    :class:`UnreadablePeer` naming the file and the package.

    Raises (constructor):
        PackcheckUsageError: not a readable zip or tar archive.
    """

    def __init__(self, path: str | Path) -> None:
        self.path, self.filename = Path(path), Path(path).name
        self._zip: zipfile.ZipFile | None = None
        self._tar: tarfile.TarFile | None = None
        if self.path.is_dir():
            raise PackcheckUsageError(f"Peer package '{path}' is a directory: pass the wheel or sdist file "
                                      "`pip download --no-deps PEER` saves.")
        if self.path.exists() and not self.path.is_file():  # a symlink to /dev/zero was read until the OOM killer
            raise PackcheckUsageError(f"Peer package '{path}' is not a regular file (a device or a pipe): pass the file "
                                      "`pip download --no-deps PEER` saves.")
        try:
            if zipfile.is_zipfile(self.path):
                self._zip = zipfile.ZipFile(self.path)
                raw = self._zip.namelist()
            else:
                self._tar = tarfile.open(self.path)  # noqa: SIM115 (closed by __exit__)
                raw = [m.name for m in self._tar.getmembers() if m.isfile()]
        except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
            lines = [line.strip(" -:") for line in str(exc).splitlines() if line.strip()]
            why = "neither a zip (wheel) nor a tar (sdist) archive" if len(lines) > 1 else (lines[0] if lines else type(exc).__name__)
            raise PackcheckUsageError(f"Peer package '{path}' is not a readable wheel or sdist ({why}): pass the file "
                                      "`pip download --no-deps PEER` saves.") from None
        self.kind = "wheel" if any(n.endswith(".dist-info/METADATA") for n in raw) else "sdist"
        self._names: dict[str, str] = {}
        for n in raw:
            short = n
            if self.kind == "sdist":
                short = n.split("/", 1)[1] if "/" in n else n
                short = short.removeprefix("src/")
            self._names.setdefault(short, n)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        (self._zip or self._tar).close()  # type: ignore[union-attr]

    def namelist(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> bytes:
        real = self._names.get(name)
        if real is None:
            raise UnreadablePeer(f"file {name} not in {self.filename}")
        size = (self._zip.getinfo(real).file_size if self._zip is not None
                else self._tar.getmember(real).size)  # type: ignore[union-attr]
        if size > MAX_MEMBER_BYTES:  # a 3 GB one-line source took 6 GB and 26 s, then a parser overflow (issue 42)
            raise UnreadablePeer(f"{name} in {self.filename} is {size / 1024 ** 2:.0f} MB unpacked, over the "
                                 f"{MAX_MEMBER_BYTES // 1024 ** 2} MB a peer's source file is read up to")
        try:
            if self._zip is not None:
                return self._zip.read(real)
            member = self._tar.extractfile(real)  # type: ignore[union-attr]
            return member.read() if member else b""
        except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise UnreadablePeer(f"cannot read {name} in {self.filename} ({type(exc).__name__}: {exc})") from None

    def parse(self, name: str) -> ast.Module:
        """The member ``name`` parsed as Python (never run).

        Raises:
            UnreadablePeer: not there, unreadable, or not valid Python ("cannot parse FILE in PACKAGE", with the line).
        """
        try:
            return ast.parse(self.read(name), filename=name)
        except (RecursionError, MemoryError, OverflowError):  # a 200,000-term expression, a 3 GB line (issue 42)
            raise UnreadablePeer(f"cannot parse {name} in {self.filename} (an expression nested too deeply for Python's "
                                 "parser)") from None
        except (SyntaxError, ValueError) as exc:
            where = f" line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
            msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
            raise UnreadablePeer(f"cannot parse {name} in {self.filename} ({msg}{where})") from None

    def metadata(self) -> str:
        """The core metadata text: a wheel's ``.dist-info/METADATA``, an sdist's top ``PKG-INFO``.

        Raises:
            PackcheckUsageError: neither is there (not a released package).
        """
        name = next((n for n in self._names if n.endswith(".dist-info/METADATA")), None) or (
            "PKG-INFO" if "PKG-INFO" in self._names else None)
        if name is None:
            raise PackcheckUsageError(f"'{self.filename}' has no .dist-info/METADATA or PKG-INFO: pass the released "
                                      "wheel or sdist (pip download --no-deps PEER).")
        return self.read(name).decode("utf-8", "replace")


def _metadata(z: PeerArchive) -> tuple[str, str, str]:
    """(name, version, transformers specifier) from the package's metadata (the first Requires-Dist on
    transformers without an extra)."""
    text = z.metadata()
    meta = dict(re.findall(r"^(Name|Version): (.+)$", text, re.MULTILINE))
    pins = [m.strip() for m in re.findall(r"^Requires-Dist: transformers\s*([^;\n]*)$", text, re.MULTILINE)]
    return meta.get("Name", "?"), meta.get("Version", "?"), pins[0].strip("()") if pins else ""


def _literal_assign(tree: ast.AST, name: str) -> tuple[Any, int] | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and value.args:  # frozenset({...})
                value = value.args[0]
            try:
                return ast.literal_eval(value), node.lineno
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
    return None


def _strings(value: Any) -> bool:
    """A list / tuple / set / frozenset of strings (what a peer's model-type literal must be to be read as claims)."""
    return isinstance(value, list | tuple | set | frozenset) and all(isinstance(v, str) for v in value)


def read_axolotl(z: PeerArchive) -> list[Claim]:
    src = "axolotl/monkeypatch/multipack.py"
    found = _literal_assign(z.parse(src), "SUPPORTED_MULTIPACK_MODEL_TYPES")
    if not found:
        raise UnreadablePeer(f"{src} in {z.filename} has no SUPPORTED_MULTIPACK_MODEL_TYPES literal (the reader needs updating)")
    types, line = found
    if not _strings(types):  # literals of the wrong type (issue 42: a number or a list of ints crashed claims)
        raise UnreadablePeer(f"{src} in {z.filename}: SUPPORTED_MULTIPACK_MODEL_TYPES is {type(types).__name__} "
                             f"{str(types)[:60]}, not a collection of model_type strings (the reader needs updating)")
    attn = _literal_assign(z.parse("axolotl/utils/schemas/enums.py"), "ATTN_IMPLS_SUPPORTING_PACKING")
    attn_names = sorted(attn[0]) if attn and _strings(attn[0]) else []
    # a modelling patch counts when it touches packing (seq_idx / cu_seqlens / packed rows): the fused-norm and
    # activation kernels of other folders do not change what a packed row attends to
    patched = {Path(n).parts[3] for n in z.namelist() if n.startswith("axolotl/monkeypatch/models/") and len(Path(n).parts) > 4
               and n.endswith(".py") and re.search(rb"seq_idx|cu_seqlens|cu_seq_lens|packing|packed", z.read(n))}
    note = f"sample packing on {', '.join(attn_names)} (ATTN_IMPLS_SUPPORTING_PACKING)" if attn_names else ""
    return [Claim("axolotl", t, True, (REFERENCE_BACKEND,), src, line,
                  own_code=f"axolotl/monkeypatch/models/{t}/" if t in patched else "", note=note) for t in types]


def read_ms_swift(z: PeerArchive) -> list[Claim]:
    claims = [Claim("ms-swift", "*", True, (REFERENCE_BACKEND,), "swift/pipelines/train/sft.py",
                    _line_of(z, "swift/pipelines/train/sft.py", "support_padding_free = not"),
                    note="a template that does not set support_padding_free: every text-only model")]
    for name in sorted(n for n in z.namelist() if n.startswith("swift/template/templates/") and n.endswith(".py")):
        tree = z.parse(name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "support_padding_free" for t in stmt.targets)
                        and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, bool)):
                    claims.append(Claim("ms-swift", f"template:{node.name}", stmt.value.value, (REFERENCE_BACKEND,), name,
                                        stmt.lineno, note="a template class (its model types are registered elsewhere)"))
    return claims


def read_llamafactory(z: PeerArchive) -> list[Claim]:
    claims = []
    for name in sorted(n for n in z.namelist() if n.startswith("llamafactory/") and n.endswith(".py")):
        tree = z.parse(name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.If):
                continue
            raises = [s for s in ast.walk(node) if isinstance(s, ast.Raise) and "packing" in ast.unparse(s).lower()]
            if not raises:
                continue
            lists = [n for n in ast.walk(node.test) if isinstance(n, ast.List | ast.Tuple | ast.Set)
                     and n.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)]
            flash = "flash_attention_2" in ast.unparse(node.test) or "flash_attention_2" in ast.unparse(_parent_if(tree, node) or node)
            for lst in lists:
                for e in lst.elts:
                    claims.append(Claim("llamafactory", e.value, False, (REFERENCE_BACKEND,) if flash else ("eager", "sdpa", REFERENCE_BACKEND),
                                        name, raises[0].lineno, own_code="neat_packing: its segment-id mask and _get_unpad_data "
                                        "patch (llamafactory/model/model_utils/packing.py)",
                                        note=ast.literal_eval(raises[0].exc.args[0]) if isinstance(raises[0].exc, ast.Call)
                                        and raises[0].exc.args and isinstance(raises[0].exc.args[0], ast.Constant) else ""))
    return claims


def _parent_if(tree: ast.AST, child: ast.AST) -> ast.If | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and child in node.body:
            return node
    return None


def _line_of(z: PeerArchive, name: str, needle: str) -> int:
    for i, line in enumerate(z.read(name).decode("utf-8", "replace").splitlines(), 1):
        if needle in line:
            return i
    return 0


def read_verl(z: PeerArchive) -> list[Claim]:
    src = "verl/models/transformers/monkey_patch.py"
    tree = z.parse(src)
    patch = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "apply_monkey_patch"), None)
    if patch is None:
        raise UnreadablePeer(f"{src} in {z.filename} has no apply_monkey_patch (the reader needs updating)")
    config = "verl/workers/config/model.py"
    default_line = _line_of(z, config, "use_remove_padding: bool = True")
    if not default_line:
        raise UnreadablePeer(f"{config} in {z.filename} does not default use_remove_padding to True (the reader needs updating)")
    flash_line = next((n.lineno for n in ast.walk(patch) if isinstance(n, ast.Attribute)
                       and n.attr == "_flash_attention_forward" and isinstance(n.ctx, ast.Store)), patch.lineno)
    claims = [Claim("verl", "*", True, (REFERENCE_BACKEND,), config, default_line, note=(
        f"use_remove_padding=True on flash_attention_2 for every model; {src}:{flash_line} replaces transformers' "
        "_flash_attention_forward with _ulysses_flash_attention_forward, which at ulysses_sp_size 1 hands the same "
        "arguments on (sequence parallel > 1 rests on verl's all-to-all, not judged)"))]
    seen: set[str] = set()
    for node in ast.walk(patch):
        if not isinstance(node, ast.If):
            continue
        for t in _model_types_tested(node.test):
            if t not in seen:
                seen.add(t)
                claims.append(Claim("verl", t, True, (REFERENCE_BACKEND,), src, node.lineno,
                                    own_code=f"{src}:{node.lineno}: verl replaces its forward / attention",
                                    note="remove padding through verl's own forward patch"))
    return claims


def _model_types_tested(test: ast.AST) -> list[str]:
    """The string model types an ``if`` compares ``....model_type`` with (``== "x"`` or ``in [...]``)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and "model_type" in ast.unparse(test.left)):
        return []
    right = test.comparators[0]
    if isinstance(test.ops[0], ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return [right.value]
    if isinstance(test.ops[0], ast.In) and isinstance(right, ast.List | ast.Tuple | ast.Set):
        return [e.value for e in right.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def read_unsloth(z: PeerArchive) -> list[Claim]:
    src = "unsloth/trainer.py"
    tree = z.parse(src)
    found = _literal_assign(tree, "PADDING_FREE_BLOCKLIST")
    if not found:
        raise UnreadablePeer(f"{src} in {z.filename} has no PADDING_FREE_BLOCKLIST literal (the reader needs updating)")
    types, line = found
    attention = "unsloth/utils/hf_packed_attention.py"
    own = f"{attention} (unsloth's varlen attention over packed rows) and unsloth's own model forwards"
    gate = _line_of(z, src, "blocked = (") or line
    claims = [Claim("unsloth", "*", True, (REFERENCE_BACKEND,), src, gate, own_code=own, note=(
        "padding-free / packing for every text model its gates do not block (blocklist, hybrid linear-attention "
        "models without its varlen shim, a forward without packed_seq_lengths or **kwargs)"))]
    for t in sorted(types):
        claims.append(Claim("unsloth", t, False, ("eager", "sdpa", REFERENCE_BACKEND), src, line,
                            own_code=own if attention in z.namelist() else "", note="PADDING_FREE_BLOCKLIST"))
    return claims


READERS = {"axolotl": read_axolotl, "ms-swift": read_ms_swift, "ms_swift": read_ms_swift, "llamafactory": read_llamafactory,
           "verl": read_verl, "unsloth": read_unsloth}


def own_code_only(name: str) -> bool:
    """A peer with no claims reader whose own packing code :mod:`.peer_paths` runs (NeMo Automodel)."""
    from .peer_paths import PEER_PATHS

    return name.lower().replace("-", "_") in {p.peer for p in PEER_PATHS} and name.lower() not in READERS


def read_wheel(path: str | Path) -> PeerClaims:
    """The claims of one peer's released package (wheel or sdist, :class:`PeerArchive`). A package that lacks the
    file or literal its reader reads is a peer entry without claims, its ``reason`` naming what is missing; a peer
    with no reader whose own code :mod:`.peer_paths` runs is an entry without claims that says so.

    Raises:
        PackcheckUsageError: not a wheel or sdist, or a package without a reader (named, with the readers there are).
    """
    with PeerArchive(path) as z:
        name, version, pin = _metadata(z)
        reader = READERS.get(name.lower())
        if reader is None and own_code_only(name):
            return PeerClaims(name, version, pin, Path(path).name, reason="no claims reader: its own packing code is run "
                              "(`--run-own-paths`), its statements are not read")
        if reader is None:
            raise PackcheckUsageError(f"Peer package '{path}' is {name}: there is no claims reader for it (readers: "
                                      f"{', '.join(sorted(set(READERS) - {'ms_swift'}))}).")
        try:
            return PeerClaims(name, version, pin, Path(path).name, _with_statements(z, reader(z)))
        except (RecursionError, MemoryError):  # what the reader walks is too deep even after parsing
            return PeerClaims(name, version, pin, Path(path).name,
                              reason=f"its source nests too deeply to read ({name} {version}); the reader needs updating")
        except UnreadablePeer as exc:
            return PeerClaims(name, version, pin, Path(path).name, reason=f"{exc} ({name} {version})")


def _with_statements(z: PeerArchive, claims: list[Claim]) -> list[Claim]:
    """``claims`` with each :attr:`Claim.statement` read: the line ``file``:``line`` of the package (stripped, cut
    at 120 characters; "" where the file or line is not there)."""
    lines: dict[str, list[str]] = {}
    for c in claims:
        if c.file not in lines:
            try:
                lines[c.file] = z.read(c.file).decode("utf-8", "replace").splitlines()
            except UnreadablePeer:
                lines[c.file] = []
        text = lines[c.file][c.line - 1].strip() if 0 < c.line <= len(lines[c.file]) else ""
        c.statement = text if len(text) <= 120 else text[:119] + "…"
    return claims


@dataclass(frozen=True)
class OwnPathLink:
    """Which of a peer's own packing paths (:data:`.peer_paths.PEER_PATHS` keys) a kind of its claims rests on.

    ``peer``: the claims' peer (:attr:`Claim.peer`); ``kind``: the claims it covers: ``packs`` (a model it packs, by
    name), ``refuses`` (a model it refuses), ``every`` (its ``"*"`` claim), ``templates`` (ms-swift's template
    classes); ``paths``: the own paths run for them; ``judges``: the paths are the own code such a claim rests on
    (:attr:`Claim.own_code`), so their verdict judges it where every path ran; ``scope``: what of the claim the paths
    run (shown beside the verdict)."""

    peer: str
    kind: str
    paths: tuple[str, ...]
    scope: str
    judges: bool = False
    #: None: every claim of the kind; True / False: only the claims that rest (do not rest) on the peer's own code
    own_code: bool | None = None
    #: own paths whose cells are shown beside the verdict but do not count toward it (verl's text-only micro-batch)
    shown: tuple[str, ...] = ()


#: The claims each own path measures (issue 45 part 2): per claim, claims.md shows the own paths' verdict beside
#: stock transformers' and the peer's statement.
OWN_PATH_LINKS: tuple[OwnPathLink, ...] = (
    OwnPathLink("axolotl", "packs", ("axolotl:multipack",), "its multipack collator, attention_mask dropped as its "
                "trainer drops it (its sdpa_varlen patch not run)", own_code=False),
    OwnPathLink("axolotl", "packs", ("axolotl:model_patches",), "its per-model packing patch under its multipack batch, "
                "at the transformers it pins (fla's kernels on packcheck's per-segment CPU reference; Mamba2's CUDA kernels "
                "not run)", judges=True, own_code=True),
    OwnPathLink("llamafactory", "refuses", ("llamafactory:neat_packing", "llamafactory:neat_packing_flash"),
                "neat_packing, the path the refusal guards"),
    OwnPathLink("ms-swift", "every", ("ms_swift:padding_free",), "its padding_free collator on text models"),
    OwnPathLink("ms-swift", "templates", ("ms_swift:padding_free",), "its padding_free collator on text models (the "
                "template's own encode and multimodal collation not run)"),
    OwnPathLink("verl", "every", ("verl:remove_padding",), "its unpad helpers and apply_monkey_patch's flash forward "
                "at ulysses_sp_size 1"),
    OwnPathLink("verl", "packs", ("verl:remove_padding",), "its flash forward patch on text models", own_code=False),
    OwnPathLink("verl", "packs", ("verl:vlm_forward",), "apply_monkey_patch's forward / attention for this model on a "
                "pixel row, at the transformers it pins (flash-attn and fla on packcheck's CPU references: the verdict is "
                "for verl with fla installed; without fla shown beside it)", judges=True,
                own_code=True, shown=("verl:vlm_forward_text", "verl:vlm_forward_no_fla")),
    OwnPathLink("unsloth", "every", ("unsloth:packing", "unsloth:hf_packed_attention"), "its packing collator and the "
                "varlen attention it installs", judges=True),
    OwnPathLink("unsloth", "refuses", ("unsloth:packing",), "its packing collator on the refused model"),
)


def _kind(claim: Claim) -> str:
    if claim.model_type == "*":
        return "every"
    if claim.model_type.startswith("template:"):
        return "templates"
    return "packs" if claim.supported else "refuses"


def own_links(claim: Claim, links: tuple[OwnPathLink, ...] = OWN_PATH_LINKS) -> list[OwnPathLink]:
    """The :data:`OWN_PATH_LINKS` entries for ``claim`` (its peer and kind)."""
    peer = claim.peer.lower().replace("_", "-")
    return [k for k in links if k.peer == peer and k.kind == _kind(claim)
            and (k.own_code is None or k.own_code == bool(claim.own_code))]


def own_verdict(claim: Claim, doc: dict[str, Any] | None, links: tuple[OwnPathLink, ...] = OWN_PATH_LINKS,
                exclude: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The verdict of the peer's own paths ``claim`` rests on (:func:`own_links`), from ``doc`` (peer_paths.json,
    :func:`.peer_paths.results_document`): None where no own path is linked or ``doc`` has none of them.

    A claim about one model reads that model's cells (or its text model's, ``<model>_text``); ``"*"`` and template
    claims read every cell but those of ``exclude`` (the models the peer names in other claims, as :func:`judge`
    leaves them out of ``"*"``). A cell whose tiny model does not build on a backend (the library refuses it) is
    shown, never counted against the claim. Returns ``{"text", "holds", "judges", "scope"}``: ``text`` per path (the verdict and the
    max abs diff of logits per backend, failures with their cause, what did not run and why, on one model the
    condition the cells' verdict is for where they carry one: verl's Qwen3.5 with / without fla); ``holds``: for a
    packing claim True where every cell ran and passes, False where one fails; for a refusal True (the refusal is
    needed) where one fails, False where every cell passes; None where a linked path did not run on it."""
    links = own_links(claim, links)
    if not links or not doc:
        return None
    keys = list(dict.fromkeys(k for link in links for k in (*link.paths, *link.shown)))
    only_shown = {k for link in links for k in link.shown} - {k for link in links for k in link.paths}
    rows = {k: [r for r in doc.get("results", []) if f"{r['peer'].lower().replace('-', '_')}:{r['path']}" == k] for k in keys}
    if not any(rows.values()):
        return None
    single = _kind(claim) in ("packs", "refuses")
    if single:
        rows = {k: [r for r in v if r["model"] in (claim.model_type, f"{claim.model_type}_text")] for k, v in rows.items()}
    else:
        rows = {k: [r for r in v if r["model"] not in exclude and r["model"].removesuffix("_text") not in exclude]
                for k, v in rows.items()}
    texts, verdicts, said = [], [], set()
    for key, these in rows.items():
        if not these:  # a shown path that does not run on this model (verl's no-fla run on a model without fla) is left out
            if key not in only_shown:
                texts.append(f"`{key}` not run on {claim.model_type} (not among the models it runs)")
                verdicts.append("not_run")
            continue
        conditions = list(dict.fromkeys(_condition_short(r["condition"]) for r in these if r.get("condition"))) if single else []
        texts.append(f"`{key}`" + (f" on {these[0]['model']}" if single else "") + ": " + _path_summary(these, single)
                     + "".join(" (the same condition)" if c in said else f" ({c})" for c in conditions)
                     + (" (shown, not counted)" if key in only_shown else ""))
        said.update(conditions)
        if key not in only_shown:
            verdicts += [r["verdict"] for r in these if not _refused_backend(r)]
    failed, ran = "fail" in verdicts, all(v in ("pass", "fail") for v in verdicts)
    # judged only where every linked cell ran: a failure of one path beside another not run is shown, not a verdict
    holds: bool | None = None if not ran else (not failed if claim.supported else failed)
    if _kind(claim) == "templates":  # a template's own encode (its model's inputs) is not what the text rows run
        return {"text": "; ".join(texts), "holds": None, "word": "not judged: the template's own encode not run",
                "judges": False, "scope": "; ".join(k.scope for k in links)}
    word = {(True, True): "holds", (True, False): "does not hold", (False, True): "the refusal is needed: its own path fails on it",
            (False, False): "its own path passes on it"}.get((claim.supported, holds), "not judged") if holds is not None else ""
    return {"text": "; ".join(texts), "holds": holds, "word": word, "judges": any(k.judges for k in links),
            "scope": "; ".join(k.scope for k in links)}


def _condition_short(text: str) -> str:
    """A cell's condition (:attr:`.peer_paths.PathResult.condition`) as a claim's line gives it: its first clause,
    the file:line parentheses left out (the peer's table in claims.md gives them whole)."""
    import re

    return re.sub(r" \([^()]*\.py:[^()]*\)", "", text.split("; ")[0])


def _path_summary(rows: list[dict[str, Any]], single: bool) -> str:
    """One path's cells in a line: per backend on one model, else counts; failures with cause; not-run reasons once."""
    def num(r: dict[str, Any]) -> str:
        return f"{r['max_abs_diff']:.1e}" + (f" ({r['cause']})" if r.get("cause") else "")

    ran = [r for r in rows if r["verdict"] in ("pass", "fail")]
    bad = [r for r in ran if r["verdict"] == "fail"]
    parts = []
    if single and ran:
        parts.append(("❌ " if bad else "✅ ") + ", ".join(f"{r['backend']} {num(r)}" for r in ran))
    elif ran:
        worst = max(r["max_abs_diff"] for r in ran)
        parts.append(f"❌ {len(bad)} of {len(ran)} cells fail: " + ", ".join(f"{r['model']}/{r['backend']} {num(r)}" for r in bad)
                     if bad else f"✅ {len(ran)} of {len(ran)} cells pass (max {worst:.1e})")
    refused = [r for r in rows if _refused_backend(r)]
    if refused:
        parts.append("the library refuses " + ", ".join(f"{r['model']}/{r['backend']}" if not single else r["backend"] for r in refused))
    other = [r for r in rows if r["verdict"] not in ("pass", "fail") and not _refused_backend(r)]
    for reason in dict.fromkeys(_cut(r.get("reason", "")) for r in other):
        these = [r for r in other if _cut(r.get("reason", "")) == reason]
        word = "⏭️ not run" if these[0]["verdict"] == "not_run" else "💥 error"
        parts.append(f"{word} ({len(these)} cell{'s' if len(these) > 1 else ''}): {reason}")
    return "; ".join(parts)


def _refused_backend(row: dict[str, Any]) -> bool:
    """A cell whose tiny model does not build on its backend because transformers refuses the attention
    implementation for that model (gpt_oss / gemma2 on sdpa): no packing verdict, never held against a claim."""
    reason = row.get("reason", "")
    return row["verdict"] == "not_run" and reason.startswith("the tiny model does not build") and "does not support" in reason


def _cut(text: str, limit: int = 260) -> str:
    """``text`` cut at ``limit`` characters (a not-run reason on a claim's line)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def pinned_release(pin: str, releases: list[str]) -> str | None:
    """The newest of ``releases`` the peer's transformers requirement allows."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import Version

    try:
        spec = SpecifierSet(pin)
    except InvalidSpecifier:
        return None
    ok = [r for r in releases if spec.contains(Version(r))]
    return max(ok, key=Version) if ok else None


def judge(claim: Claim, support: dict[str, Any], release: str | None, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The claim against the atlas at ``release`` (the newest the peer's pin allows): ``holds`` True / False / None
    (not judged: own code, a template, not measured there), with the answers behind it. Each (model type, backend)
    is answered by :func:`pytest_packcheck.support.answer_at`, the answer ``packcheck lookup`` gives at that
    release (measured there, or placed on one side of a transition by a found bisect), so a claim and a lookup
    never disagree; where lookup has no answer (not measured, a transition not placed) the claim is not judged and
    the nearest measured releases are named. ``answers`` / ``bad``: ``(model_type, backend, Answer)``.
    ``exclude``: model types a ``"*"`` claim does not cover (those the same peer claims by name, e.g. on its own
    patch)."""
    from ..support import answer_at

    out: dict[str, Any] = {"claim": claim, "release": release}
    if claim.own_code and claim.supported:
        return {**out, "holds": None, "why": f"rests on the peer's own code: {claim.own_code}"}
    if claim.model_type.startswith("template:") or release is None:
        return {**out, "holds": None, "why": "a template class, not a model type" if release else "no pinned release in the atlas plan"}
    types = sorted(set(support["cells"]) - exclude) if claim.model_type == "*" else [claim.model_type]
    asked = [(t, backend, answer_at(support, t, backend, release)) for t in types for backend in claim.backends
             if support["cells"].get(t, {}).get(backend)]
    if not asked:
        return {**out, "holds": None, "why": f"{claim.model_type} is not in the atlas"}
    answers = [x for x in asked if x[2].answered]
    judged = [x for x in answers if x[2].verdict in JUDGED_VERDICTS]
    if claim.model_type == "*":
        unanswered = len(asked) - len(answers)
        if not judged:
            return {**out, "holds": None, "answers": answers,
                    "why": f"no model has a packing verdict at {release}: {_nearest_measured(support, release)}"}
        bad = [x for x in judged if x[2].verdict != "pass"]
        left = ""
        if unanswered and any(r["transformers"] == release for r in support["releases"]):
            left = f"{unanswered} more have no entry at {release} (measured only at other releases): not judged"
        elif unanswered:
            left = f"{unanswered} more not measured at {release} ({_nearest_measured(support, release)}): not judged"
        return {**out, "holds": not bad, "answers": answers, "bad": bad,
                "why": (f"{len(bad)} of {len(judged)} measured text models do not pass ({len(answers) - len(judged)} more have "
                        "no verdict: the library refuses the backend or its config does not build" + (f"; {left}" if left else "") + ")")
                if bad else "every measured model passes" + (f" ({left})" if left else "")}
    # one model on each backend the claim covers (a refusal covers all three): judged on every backend with a
    # packing verdict, each named (the atlas review found unsloth's "refuses gpt_oss" judged on eager alone, beside
    # LLaMA-Factory's same refusal judged on the flash path: opposite verdicts, no backend named)
    named = len(asked) > 1

    def text(backend: str, a: Any) -> str:
        return f"{backend}: {_answer_text(a, release)}" if named else _answer_text(a, release)

    if not judged:
        a = asked[0][2]
        if not a.answered:
            return {**out, "holds": None, "answers": [], "why": _answer_text(a, release)}
        return {**out, "holds": None, "answers": answers,
                "why": "no packing verdict: " + "; ".join(text(b, x) for _, b, x in asked)}
    bad = [x for x in judged if x[2].verdict != "pass"]
    # a claim of support holds where every measured backend passes; a refusal where packing fails on one of them
    holds = not bad if claim.supported else bool(bad)
    return {**out, "holds": holds, "answers": answers, "bad": bad, "why": "; ".join(text(b, x) for _, b, x in asked)}


def judge_with_own_path(j: dict[str, Any], own_paths: dict[str, Any] | None, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """:func:`judge`'s result with the own paths' verdict (:func:`own_verdict`) under ``"own"``; a claim that rests
    on the peer's own code and that stock transformers does not judge is judged by it where its links ``judges``
    and every linked path ran (``holds`` from the own paths, ``why`` saying so); otherwise it stays not judged, the
    own paths' verdict (or why they did not run) beside the reason."""
    claim = j["claim"]
    own = own_verdict(claim, own_paths, exclude=exclude)
    if own is None:
        return j
    j = {**j, "own": own}
    if j["holds"] is None and claim.own_code and claim.supported and own["judges"]:
        if own["holds"] is not None:
            return {**j, "holds": own["holds"], "own_judged": True,
                    "why": f"judged by its own code, run on CPU: {own['text']}"}
        j["why"] += "; its own code, run, does not judge it: a linked path did not run here"
    return j


#: Verdicts a claim is judged on: a pass, or a measured failure (the requested backend ran and the numbers are out
#: of tolerance, or another backend ran). unsupported / error / skipped carry no packing verdict.
JUDGED_VERDICTS = ("pass", "fail", "fallback")


def _nearest_measured(support: dict[str, Any], release: str) -> str:
    """"the nearest measured releases are A and B": the atlas's measured releases on each side of ``release``."""
    from packaging.version import Version

    measured = sorted((r["transformers"] for r in support["releases"]), key=Version)
    below = [v for v in measured if Version(v) < Version(release)]
    above = [v for v in measured if Version(v) > Version(release)]
    near = [v for v in (below[-1] if below else None, above[0] if above else None) if v]
    return f"the nearest measured release{'s are' if len(near) > 1 else ' is'} {' and '.join(near)}" if near else "nothing measured"


def _answer_text(a: Any, release: str) -> str:
    """One answer (:class:`pytest_packcheck.support.Answer`) on a claim's line: the verdict, causes, key number and
    the release it was measured at; placed by a bisect: which; not measured: "not judged", the nearest measured
    releases and lookup's reason."""
    if not a.answered:
        why = "; ".join(n for n in a.notes if "answered from" not in n)
        return f"not judged: {a.summary().replace('not measured', f'not measured at {release}', 1)}" + (f"; {why}" if why else "")
    text = _entry_text({"verdict": a.verdict, "causes": a.causes, "check": a.check, "number": a.number}, a.measured_at)
    return text if a.measured else f"{text}, {release} placed on its side by the {a.inferred_from}"


def _entry_text(e: dict[str, Any], measured_at: str) -> str:
    num = f" {e['check']} {e['number']:.1e}" if e.get("number") is not None and e.get("check") else ""
    causes = f" [{', '.join(e.get('causes', []))}]" if e.get("causes") else ""
    return f"{e['verdict']}{causes}{num} at {measured_at}"


#: The groups of claims.md, each with the name its count has in the peer's "Counts" line.
COUNT_NAMES = {"Claims that hold": "hold", "Claims that do not hold": "do not hold",
               "Refused, and measured safe on stock transformers": "refused but measured safe",
               "Rest on the peer's own patch or kernel": "rest on the peer's own patch or kernel", "Not judged": "not judged"}


def claim_groups(judged: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """:func:`judge` results by :data:`COUNT_NAMES` group: a claim that holds; a packing claim that does not; a
    refusal of a model the atlas measures as passing; a packing claim on the peer's own patch or kernel (not
    judged against stock code); the rest (templates, not measured, no verdict)."""
    own = [j for j in judged if j["holds"] is None and j["claim"].own_code and j["claim"].supported]
    return dict(zip(COUNT_NAMES, (
        [j for j in judged if j["holds"] is True],
        [j for j in judged if j["holds"] is False and j["claim"].supported],
        [j for j in judged if j["holds"] is False and not j["claim"].supported],
        own,
        [j for j in judged if j["holds"] is None and all(j is not o for o in own)]), strict=True))


def render_claims(peers: list[PeerClaims], support: dict[str, Any], own_paths: dict[str, Any] | None = None) -> str:
    """claims.md: per peer its version, pin and files; the claims that hold, those that do not (with the number),
    the models it refuses that the atlas measures as passing, and the claims on the peer's own code; with
    ``own_paths`` (:func:`.peer_paths.results_document`), each peer's own packing code as run on CPU."""
    from .peer_paths import render_own_paths

    plan = [r["transformers"] for r in support["releases"]] + list(support.get("missing", []))
    measured = [r["transformers"] for r in support["releases"]]
    lines = ["# What other tools claim about packing, against the atlas", "",
             ("Read from each peer's released wheel or sdist (`pip download --no-deps`, parsed with `ast`, not imported) and judged "
             "against `support.json` at the newest release of the atlas's plan (the latest patch of each minor) the peer's "
             "transformers pin allows, on the atlas columns each claim is about (named where there are several), each "
             "model answered as `packcheck lookup` "
             "answers it at that release: measured there, or placed on one side of a transition by a bisect (named); "
             "otherwise the claim is not judged and the nearest measured releases are named. "
             f"Atlas releases measured: {', '.join(measured)}."), ""]
    for p in peers:
        pin_release = pinned_release(p.transformers_pin, plan)
        notes = sorted({c.note for c in p.claims if c.note and c.peer == "axolotl"})
        kind = "Wheel" if p.wheel.endswith(".whl") else "Sdist"
        lines += [f"## {p.peer} {p.version}", "", f"{kind} `{p.wheel}`; requires transformers `{p.transformers_pin or 'any'}` "
                  f"-> judged at {pin_release or 'no atlas release'}"
                  + (" (not measured there: a model is judged where a bisect places this release, else not judged)"
                     if pin_release and pin_release not in measured else "")
                  + "." + (f" Claims: {'; '.join(notes)}; judged on the atlas's packcheck_flash_ref column." if notes else ""), ""]
        lines += render_own_paths(own_paths or {}, p.peer, p.transformers_pin)
        if p.reason:
            lines += [f"No claims read: {p.reason}.", ""]
            continue
        named = frozenset(c.model_type for c in p.claims if c.model_type != "*")
        judged = [judge_with_own_path(judge(c, support, pin_release, named), own_paths, named) for c in p.claims]
        groups = claim_groups(judged)
        linked = list(dict.fromkeys((k.kind, k.paths, k.scope) for j in judged if j.get("own") for k in own_links(j["claim"])))
        if linked:
            kinds = {"packs": "a model it packs", "refuses": "a model it refuses", "every": "its claim on every model",
                     "templates": "its templates"}
            lines += ["Own code behind the claims (each claim's line below gives its verdict): " + "; ".join(
                f"{kinds[kind]}: {', '.join(f'`{x}`' for x in paths)} ({scope})" for kind, paths, scope in linked) + ".", ""]
        lines += ["Counts: " + ", ".join(f"{len(items)} {COUNT_NAMES[title]}" for title, items in groups.items()) + ".", ""]
        for title, items in groups.items():
            lines.append(f"**{title}** ({len(items)}):")
            lines.append("")
            for j in items:
                c = j["claim"]
                what = ("packs" if c.supported else "refuses") + f" {c.model_type}" + (f" ({c.note})" if c.note and c.peer != "axolotl" else "")
                where = f"`{c.file}:{c.line}`"
                detail = j["why"]
                if j.get("bad") and c.model_type == "*":  # one model: "why" names each backend already
                    detail += ": " + ", ".join(f"{t}/{b} {_answer_text(a, j['release'])}" for t, b, a in j["bad"][:40])
                    if len(j["bad"]) > 40:
                        detail += f", ... ({len(j['bad']) - 40} more)"
                if not c.supported and j["holds"] is False:
                    detail = "refused, and the atlas measures it as passing on stock transformers: " + detail
                if not c.supported and c.own_code:
                    detail += f" (the refusal is of the peer's own path: {c.own_code})"
                lines.append(f"- {what}, {where}: {detail}")
                own = j.get("own")
                sub = [f"statement: `{c.statement.replace('`', chr(39))}`"] if c.statement else []
                if own:
                    sub.append(f"own code, run{' (' + own['word'] + ')' if own['word'] else ''}: {own['text']}")
                if sub:
                    lines.append("  - " + "; ".join(sub))
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
