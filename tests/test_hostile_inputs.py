"""Every reader of a user's file refuses a hostile shape in one line (issue 42, kind 1): one bounded reader
(:func:`pytest_packcheck.errors.read_document`: regular file, size, UTF-8, format, nesting) behind the support file,
results files (gate / merge / --seed / baseline), audit and tolerance files, a model's config.json and the atlas run
records; the claims reader survives a peer's source it cannot walk; the public ``lookup()`` checks its arguments'
types. Each case was a traceback (RecursionError, InvalidVersion, TypeError) or an unbounded read before."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cli_inprocess import packcheck, pytest_run

from pytest_packcheck.errors import PackcheckUsageError, nesting_depth, parse_document, read_document
from pytest_packcheck.results.schema import read_results

DEEP = 100_000


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``packcheck ARGS`` in this process (tests/cli_inprocess.py): the tests that call it are about the words, the
    exit code and the files written; those about a process boundary (a closed or full terminal, a signal, a read
    that could hang, cache variables) start their own subprocess below."""
    return packcheck(*args, cwd=cwd)


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    (tmp_path / "deep.json").write_text("[" * DEEP + "]" * DEEP)
    (tmp_path / "deepobj.json").write_text('{"a":' * DEEP + "1" + "}" * DEEP)
    (tmp_path / "deep.toml").write_text("a = " + "[" * DEEP + "]" * DEEP + "\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * DEEP + "]" * DEEP + "}")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    return tmp_path


@pytest.mark.parametrize("args", [
    ["lookup", "llama", "sdpa", "5.24.0", "--support-file", "deep.json"],
    ["lookup", "llama", "sdpa", "5.24.0", "--support-file", "deepobj.json"],
    ["lookup", "llama", "sdpa", "5.24.0", "--support-file", "zero.json"],
    ["lookup", "./model", "sdpa", "5.24.0"],
    ["gate", "--baseline", "deep.json", "--candidate", "deep.json"],
    ["gate", "--baseline", "zero.json", "--candidate", "zero.json"],
    ["merge", "deepobj.json", "deep.json"],
    ["atlas", "--render-only", "--seed", "deep.json", "--build-dir", "b", "-o", "o"],
    ["audit", "--audit", "deep.toml"],
    ["audit", "--models", "./model", "-n", "0"],
], ids=["lookup-deep", "lookup-deep-object", "lookup-dev-zero", "lookup-config", "gate-deep", "gate-dev-zero", "merge",
        "atlas-seed", "audit-file", "model-config"])
def test_a_hostile_file_is_one_line_exit_2(hostile, args):
    proc = _cli(args, hostile)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-1500:]
    assert "Traceback" not in out and "RecursionError:" not in out and "INTERNALERROR" not in out, out[-1500:]
    said = [line for line in out.splitlines() if line.strip()]
    assert any(("nests" in line or "not a regular file" in line) and ("deep" in line or "zero" in line or "config.json" in line)
               for line in said), said


def test_the_bounded_reader_on_its_own(tmp_path, monkeypatch):
    """Planted: each hostile shape against read_document / parse_document directly, and a file over the size bound
    ($PACKCHECK_MAX_FILE_MB) refused before it is read."""
    assert nesting_depth({"a": [[1]]}) == 3 and nesting_depth(5) == 0 and nesting_depth([[[[]]]], limit=2) == 3
    with pytest.raises(PackcheckUsageError, match="more deeply than a parser can follow"):
        parse_document("[" * DEEP + "]" * DEEP, "json", "X", "fix")
    with pytest.raises(PackcheckUsageError, match="over 64 levels deep"):
        parse_document("[" * 200 + "]" * 200, "json", "X", "fix")  # parses, but deeper than any packcheck file
    with pytest.raises(PackcheckUsageError, match=r"X is not valid TOML"):
        parse_document("a = [", "toml", "X", "fix")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600_000 + "0]")
    monkeypatch.setenv("PACKCHECK_MAX_FILE_MB", "1")
    with pytest.raises(PackcheckUsageError, match=r"is 1 MB, over the 1 MB packcheck reads \(\$PACKCHECK_MAX_FILE_MB"):
        read_document(big, "json", "Results file", "fix")
    monkeypatch.setenv("PACKCHECK_MAX_FILE_MB", "lots")
    with pytest.raises(PackcheckUsageError, match="PACKCHECK_MAX_FILE_MB='lots' .from the environment."):
        read_document(big, "json", "Results file", "fix")
    monkeypatch.delenv("PACKCHECK_MAX_FILE_MB")
    assert len(read_document(big, "json", "Results file", "fix")) == 600_001


@pytest.mark.parametrize(("args", "says"), [
    (("llama", "sdpa", None), "transformers_version is NoneType None, not a string"),
    (("llama", "sdpa", 5.24), "transformers_version is float 5.24, not a string"),
    (("llama", "sdpa", ["5.24.0"]), "transformers_version is list"),
    (("llama", "sdpa", "5." + "9" * 5000), "transformers_version argument is 5002 characters long"),
    ((None, "sdpa", "5.24.0"), "model_type is NoneType"),
    (("llama", 3, "5.24.0"), "attn_implementation is int 3"),
    (("llama", "sdpa", "5.24.0", 1.16), "trl_version is float 1.16"),
])
def test_lookups_public_api_checks_its_arguments_types(args, says):
    from pytest_packcheck.support import lookup

    with pytest.raises(PackcheckUsageError, match=says.replace(".", r"\.").replace("(", r"\(")):
        lookup(*args)


def _axolotl_wheel(path: Path, multipack: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("axolotl-1.0.dist-info/METADATA", "Name: axolotl\nVersion: 1.0\nRequires-Dist: transformers>=4.50\n")
        z.writestr("axolotl/monkeypatch/multipack.py", multipack)
        z.writestr("axolotl/utils/schemas/enums.py", "ATTN_IMPLS_SUPPORTING_PACKING = {'flash_attention_2'}\n")
    return path


@pytest.mark.parametrize(("source", "reason"), [
    ("SUPPORTED_MULTIPACK_MODEL_TYPES = " + "1+" * 200_000 + "1\n", "nested too deeply"),
    ("SUPPORTED_MULTIPACK_MODEL_TYPES = 5\n", "is int 5, not a collection of model_type strings"),
    ("SUPPORTED_MULTIPACK_MODEL_TYPES = [1, 2]\n", "is list [1, 2], not a collection of model_type strings"),
], ids=["200k-term-expression", "a-number", "a-list-of-ints"])
def test_claims_reads_a_peer_it_cannot_walk_as_an_entry_with_its_reason(tmp_path, source, reason):
    from pytest_packcheck.atlas.claims import read_wheel

    peer = read_wheel(_axolotl_wheel(tmp_path / "axolotl-1.0-py3-none-any.whl", source))
    assert peer.claims == [] and reason in peer.reason, peer.reason
    good = read_wheel(_axolotl_wheel(tmp_path / "good.whl", "SUPPORTED_MULTIPACK_MODEL_TYPES = ['llama', 'qwen2']\n"))
    assert [c.model_type for c in good.claims] == ["llama", "qwen2"]


@pytest.mark.parametrize("target", ["full", "closed"])
@pytest.mark.parametrize("command", ["lookup", "audit"])
def test_a_terminal_that_cannot_be_written_is_one_line_and_the_reports_are_written(tmp_path, command, target):
    """Issue 42, kind 2: stdout on a full device (/dev/full) or closed (`>&-`) gave tracebacks, and a closed one no
    matrix. The work is done, the reports written, one line on stderr says the output was dropped; lookup's answer
    never reached its reader: exit 74; the audit exits as its verdicts say (0 here)."""
    args = ({"lookup": ["lookup", "llama", "sdpa", "5.24.0"],
             "audit": ["audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
                       "-n", "0", "-q"]})[command]
    stdout = open("/dev/full", "w") if target == "full" else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=tmp_path, stdout=stdout,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=300,
                              pass_fds=(), close_fds=True, **({"preexec_fn": lambda: __import__("os").close(1)}
                                                                if target == "closed" else {}))
    finally:
        if target == "full":
            stdout.close()
    assert "Traceback" not in proc.stderr and "INTERNALERROR" not in proc.stderr, proc.stderr[-1500:]
    said = [line for line in proc.stderr.splitlines() if "standard output could not be written" in line]
    assert len(said) == 1, proc.stderr[-1500:]
    assert ("No space left on device" if target == "full" else "standard output is closed") in said[0]
    if command == "lookup":
        assert proc.returncode == 74
    else:
        assert proc.returncode == 0 and "the reports were written as usual" in said[0]
        assert (tmp_path / "reports" / "packcheck-matrix.json").exists()


@pytest.mark.parametrize("var", ["PACKCHECK_CACHE_DIR", "XDG_CACHE_HOME"])
def test_a_cache_setting_that_is_not_a_folder_is_refused_before_any_cell(tmp_path, var):
    """Issue 42, kind 3: a cache variable naming a file turned every cell of a version audit into "the process running
    this cell died", exit 0. It is checked once, before any cell or environment, naming the variable."""
    (tmp_path / "afile").write_text("")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PACKCHECK_CACHE_DIR", "XDG_CACHE_HOME")}
    env[var] = str(tmp_path / "afile")
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama",
                           "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-q",
                           "--versions", "transformers==5.24.0"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-1500:]
    assert f"${var}=" in out and "cannot be used (Not a directory" in out and f"point {var} at a folder" in out, out[-1500:]
    assert not (tmp_path / "reports" / "packcheck-matrix.json").exists()


def test_packcheck_report_dir_is_honoured_by_the_audit(tmp_path):
    env = {**__import__("os").environ, "PACKCHECK_REPORT_DIR": str(tmp_path / "elsewhere")}
    proc = packcheck("audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
                     "-n", "0", "-q", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert (tmp_path / "elsewhere" / "packcheck-matrix.json").exists() and not (tmp_path / "reports").exists()
    assert proc.stdout.strip().splitlines()[-1].startswith("packcheck audit: no matrix cell fails")  # read from there


@pytest.mark.parametrize("workers", ["0", "2"])
def test_cells_deselected_with_k_are_not_missing_regressions(tmp_path, workers):
    """Issue 42: `-k` with a full baseline counted every deselected cell as "REGRESSION (missing)". The run records
    them (settings.deselected; under xdist the controller infers them) and the gate leaves them out. Planted: the
    same candidate without the record counts the missing cell."""

    from pytest_packcheck.analysis.gate import compare, regressions

    base = ["audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation,logits_parity",
            "-n", workers, "-q"]
    assert _cli([*base, "--save-baseline"], tmp_path).returncode == 0
    baseline = tmp_path / "reports" / "baseline.json"
    proc = _cli([*base, "--packcheck-baseline", str(baseline), "--", "-k", "isolation"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    doc = read_results(tmp_path / "reports" / "packcheck-matrix.json")
    assert doc["settings"]["deselected"] == ["llama-sdpa-logits_parity-float32"]
    before = read_results(baseline)
    assert regressions(compare(before, doc)) == []
    doc["settings"].pop("deselected")
    assert [c.detail for c in regressions(compare(before, doc))] == ["cell missing in candidate"]


def test_non_finite_logits_are_non_finite_on_every_check_that_measures_numbers(tmp_path):
    """Issue 42: a config that makes every logit NaN (rms_norm_eps=-1e9) passed edge_lengths and causality at 0.00e+00
    and sent the traps to wrong_positions. Decided once per model from the cached packed forward: every check with a
    key number is an error with cause non_finite and the count of bad logits; the call-count check still passes;
    a healthy llama is untouched (the planted fault is the config)."""

    from pytest_packcheck.checks.registry import SPECS

    proc = _cli(["audit", "--models", "arch:llama{rms_norm_eps=-1e9},arch:llama", "--packcheck-attn", "sdpa", "-n", "0", "-q"],
                tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    cells = read_results(tmp_path / "reports" / "packcheck-matrix.json")["cells"]
    nan = [c for c in cells if "rms_norm_eps" in c["model"]["label"] and c["backend"] is not None]
    numeric = [c for c in nan if SPECS[c["check"]].key_metric]
    assert numeric and all(c["status"] == "error" and c["cause"] == "non_finite" for c in numeric), [
        (c["check"], c["status"], c["cause"]) for c in numeric]
    assert all(c["metrics"]["non_finite_logits"]["packed"] > 0 for c in numeric)
    assert [c["status"] for c in nan if c["check"] == "backend"] == ["pass"]
    healthy = [c for c in cells if c["model"]["label"] == "llama" and c["backend"] is not None]
    assert healthy and not any(c.get("cause") == "non_finite" for c in healthy)


def test_secrets_are_scrubbed_where_they_stand_and_plain_words_are_not():
    """Issue 42, secrets: a URL's user:password, a token's shape and a secret-named variable's value are masked; a
    secret-named variable whose value is plain words (an identifier) no longer rewrites cell ids."""
    import os

    from pytest_packcheck.errors import scrub_secrets

    old = dict(os.environ)
    try:
        os.environ.update({"MY_API_KEY": "llama-sdpa-isolation", "OTHER_TOKEN": "S3cr3tValue99"})
        text = scrub_secrets("llama-sdpa-isolation-float32 S3cr3tValue99 https://bob:pw@idx.example/simple git@github.com:a/b")
        assert text == "llama-sdpa-isolation-float32 *** https://***@idx.example/simple git@github.com:a/b"
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.mark.parametrize("how", ["audit", "pytest"])
def test_a_token_in_k_never_reaches_the_terminal(tmp_path, how):
    token = "ghp_" + "Ab1" * 12
    if how == "audit":
        proc = packcheck("audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
                         "-n", "0", "-q", "--", "-k", token, cwd=tmp_path)
    else:
        proc = pytest_run("-p", "no:cacheprovider", "--packcheck-models", "arch:llama", "--packcheck-attn", "sdpa",
                          "--packcheck-checks", "isolation", "-q", "-k", token, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "deselected" in out or "deselect" in out, out[-1500:]  # the line that used to echo it is there
    assert token not in out, out[-1500:]


def test_an_index_url_with_credentials_is_opened_with_basic_auth_and_never_printed(monkeypatch):
    """Issue 42: UV_INDEX_URL=https://user:password@host/simple was an INTERNALERROR (urllib read the password as a
    port) that printed it. A loopback index checks the Authorization header; a malformed URL is an OSError whose
    text masks the credentials."""
    import base64
    import http.server
    import json
    import threading

    from pytest_packcheck.versions.releases import open_index, release_versions

    seen: list[str | None] = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"versions": ["5.24.0", "5.25.0"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for var in ("UV_DEFAULT_INDEX", "PIP_INDEX_URL"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("UV_INDEX_URL", f"http://bob:s3cr%40t@127.0.0.1:{server.server_port}/simple")
        assert release_versions("transformers") == ["5.24.0", "5.25.0"]
        assert seen == ["Basic " + base64.b64encode(b"bob:s3cr@t").decode()]
    finally:
        server.shutdown()
    with pytest.raises(OSError) as info:
        open_index("http://bob:s3cret@host:notaport/simple", 5)
    assert "s3cret" not in str(info.value) and "***@" in str(info.value)


def test_nothing_finished_is_lost_by_collect_only_or_a_new_model_order(tmp_path):
    """Issue 42: `pytest --collect-only` emptied an interrupted run's journal (and removed its matrix); --resume with the
    same models in another order reused nothing. Planted: a finished run, then both."""

    base = ["--packcheck-attn", "sdpa", "--packcheck-checks", "isolation"]
    assert _cli(["audit", "--models", "arch:llama,arch:gpt2", *base, "-n", "0", "-q"], tmp_path).returncode == 0
    journal = tmp_path / "reports" / "packcheck-journal.jsonl"
    lines = journal.read_text().splitlines()
    assert len(lines) == 2
    proc = pytest_run("-p", "no:cacheprovider", "--packcheck-models", "arch:llama,arch:gpt2", *base, "--collect-only", "-q",
                      cwd=tmp_path)
    assert proc.returncode == 0 and "left as they were" in proc.stdout, proc.stdout[-1500:]
    assert journal.read_text().splitlines() == lines and (tmp_path / "reports" / "packcheck-matrix.json").exists()
    again = _cli(["audit", "--models", "arch:gpt2,arch:llama", *base, "-n", "0", "-q", "--resume"], tmp_path)
    assert "Resumed: 2 of 2 cells were taken from the journal" in again.stdout, again.stdout[-1500:]
    doc = read_results(tmp_path / "reports" / "packcheck-matrix.json")
    assert doc["resumed"] == {"cells": 2, "of": 2}


def test_an_atlas_render_from_support_json_alone_keeps_its_placements_and_trl_block_and_writes_one_set(tmp_path, monkeypatch):
    """Issue 42: `packcheck atlas --render-only` from a folder holding only support.json dropped the bisect placements
    and the TRL block and exited 0; the three outputs were written one by one (a kill left a mixed set). Planted: the
    committed support.json alone; then a render that fails on atlas.html leaves the earlier set untouched."""
    import json
    import shutil

    from pytest_packcheck.atlas import render as R
    from pytest_packcheck.atlas.command import AtlasArgs, main

    repo = Path(__file__).resolve().parent.parent
    committed = json.loads((repo / "reports" / "atlas" / "support.json").read_text())
    out = tmp_path / "o"
    out.mkdir()
    shutil.copy(repo / "reports" / "atlas" / "support.json", out / "support.json")
    releases = [r["transformers"] for r in committed["releases"]]
    args = AtlasArgs(releases=releases, build=tmp_path / "b", out=out, shard=None, workers=1, render_only=True,
                     bisect=False, bisect_limit=None)
    assert main(args, log=lambda _line: None) == 0
    got = json.loads((out / "support.json").read_text())
    placed = sum((t.get("bisected") or {}).get("outcome") == "found" for t in got["transitions"])
    # the committed atlas's bisect placements (592 after the config-fix re-measure: transitions it added are not
    # bisected yet), every one kept
    assert placed == sum((t.get("bisected") or {}).get("outcome") == "found" for t in committed["transitions"]) > 500
    assert got["trl"] == committed["trl"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(_support):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(R, "render_html", broken)
    with pytest.raises(OSError):
        main(args, log=lambda _line: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier set, whole


def test_a_killed_run_leaves_the_previous_set_aside_never_beside_its_journal(tmp_path):
    """Issue 42, reports are one set: after a SIGKILL mid-run (as after a full disk or a SIGHUP) the previous audit's
    complete set stayed in the folder unmarked, beside the new run's journal. A run that takes the folder moves the
    old set into previous/ first, and drops it once its own set is written. Planted: a SIGKILL at the second cell."""
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--packcheck-models", "arch:llama",
            "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation,logits_parity", "--packcheck-isolation=none", "-q"]
    first = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    reports = tmp_path / "reports"
    assert first.returncode == 0 and (reports / "packcheck-matrix.json").exists(), first.stdout[-1500:]
    assert not (reports / "previous").exists()  # a finished run leaves no set aside
    (tmp_path / "conftest.py").write_text(
        "import os, signal\nseen = []\n"
        "def pytest_runtest_call(item):\n    seen.append(item)\n    if len(seen) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    assert killed.returncode == -9
    assert not (reports / "packcheck-matrix.json").exists() and not (reports / "packcheck-matrix.md").exists()
    assert (reports / "previous" / "packcheck-matrix.json").exists() and (reports / "previous" / "packcheck-matrix.md").exists()
    assert len((reports / "packcheck-journal.jsonl").read_text().splitlines()) == 1  # the cell that finished


def test_a_child_killed_from_outside_is_killed_not_an_upstream_crash_and_resume_reruns_it(tmp_path):
    """Issue 42, causes that blame the wrong party: a cell child SIGKILLed from outside (the OOM killer, `kill -9`) was
    `crash` "report it upstream", and --packcheck-resume kept it. Now cause killed, not journaled, rerun on resume.
    Planted: the child kills itself with SIGKILL inside the first check."""

    (tmp_path / "conftest.py").write_text(
        "import os, signal\nimport pytest_packcheck.checks.registry as R\n"
        "def pytest_configure(config):\n"
        "    spec = R.SPECS['isolation']\n"
        "    if os.environ.get('PLANT_KILL'):\n"
        "        object.__setattr__(spec, 'load', lambda: (lambda bench: os.kill(os.getpid(), signal.SIGKILL)))\n")
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--packcheck-models", "arch:llama",
            "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-q"]
    env = {**__import__("os").environ, "PLANT_KILL": "1"}
    killed = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300, env=env)
    cell = read_results(tmp_path / "reports" / "packcheck-matrix.json")["cells"][0]
    assert cell["status"] == "error" and cell["cause"] == "killed", (cell, killed.stdout[-1000:])
    assert "killed from outside" in cell["message"] and "upstream" not in cell["diagnosis"]["remedy"]
    assert (tmp_path / "reports" / "packcheck-journal.jsonl").read_text() == ""
    env.pop("PLANT_KILL")
    again = subprocess.run([*args, "--packcheck-resume"], cwd=tmp_path, capture_output=True, text=True, check=False,
                           timeout=300, env=env)
    cell = read_results(tmp_path / "reports" / "packcheck-matrix.json")["cells"][0]
    assert cell["status"] == "pass" and "Resumed" not in again.stdout, again.stdout[-1000:]


def test_a_crash_under_the_users_override_blames_the_override(tmp_path):
    """Issue 42: arch:gpt2{n_positions=4} (a 4-position table for a 13-token row) crashed and was shrunk_crash,
    "packcheck's to fix". With the user's overrides it is override_config, naming them; without, the model passes."""

    proc = _cli(["audit", "--models", "arch:gpt2{n_positions=4},arch:gpt2", "--packcheck-attn", "sdpa",
                 "--packcheck-checks", "isolation", "-n", "0", "-q"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-1000:]
    cells = {c["model"]["label"]: c for c in read_results(tmp_path / "reports" / "packcheck-matrix.json")["cells"]}
    bad = cells["gpt2{n_positions=4}"]
    assert bad["cause"] == "override_config" and "your overrides (n_positions=4)" in bad["message"], bad["message"]
    assert "packcheck's to fix" not in bad["diagnosis"]["remedy"]
    assert cells["gpt2"]["status"] == "pass"


@pytest.mark.parametrize(("args", "says"), [
    (["--batch-size", "100000", "--max-length", "4096"], "100000 x 4096 tokens) needs about"),
    (["--model", ("arch:llama{hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
                  "num_key_value_heads=32,vocab_size=32000}"), "--full-size"], "at full size (6.74B parameters, float32) needs about"),
    (["--steps", str(10 ** 23)], "is over 10,000: a bench's figures settle within tens of steps"),
], ids=["a-batch-that-cannot-fit", "7b-in-float32", "steps-without-bound"])
def test_bench_refuses_what_cannot_fit_with_the_size_it_needs(tmp_path, args, says):
    """Issue 42, bounded work: bench with a batch or a model that cannot fit grew until the OOM killer. It estimates
    (weights, gradients, activations of the padded batch, logits) against the memory available and refuses in one
    line naming the size, before anything is built (the 7B model is counted on the meta device)."""
    import time

    started = time.perf_counter()
    steps = [] if "--steps" in args else ["--steps", "1"]
    proc = _cli(["bench", *(args if "--model" in args else ["--model", "arch:llama", *args]), *steps,
                 "--warmup", "1", "-o", str(tmp_path / "b")], tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-1500:]
    line = proc.stderr.strip().splitlines()[-1]
    assert says in line and ("GB available" in line and "lower --batch-size" in line or "--steps" in line), line
    assert time.perf_counter() - started < 120 and not (tmp_path / "b" / "bench.json").exists()


def test_unreadable_weights_are_the_checkpoints_not_upstreams(tmp_path):
    """Issue 42: a corrupt weights file under --packcheck-weights=pretrained was a crash with no cause and the remedy
    "report it upstream". Now weights_unreadable, naming the read error; the same folder with its real weights runs.
    One audit of three copies of one saved model (each model's cells are their own; one subprocess, not four):
    ``real`` keeps its weights, ``truncated`` and ``garbage`` get a planted weights file."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "real")
    planted = {"truncated": b"\x00" * 4, "garbage": bytes(range(256)) * 20}
    for name, content in planted.items():
        shutil.copytree(tmp_path / "real", tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(content)
    folders = ",".join(str(tmp_path / name) for name in ("real", *planted))
    proc = _cli(["audit", "--models", folders, "--packcheck-weights", "pretrained", "--packcheck-attn", "sdpa",
                 "--packcheck-checks", "isolation", "-n", "0", "-q"], tmp_path)
    cells = {c["model"]["label"]: c for c in read_results(tmp_path / "reports" / "packcheck-matrix.json")["cells"]}
    assert set(cells) == {"real", *planted}, (sorted(cells), (proc.stdout + proc.stderr)[-1500:])
    assert cells["real"]["status"] == "pass", cells["real"]["message"]
    for name in planted:
        cell = cells[name]
        assert cell["status"] == "error" and cell["cause"] == "weights_unreadable", (name, cell["cause"], cell["message"])
        assert "cannot be read" in cell["message"] and "upstream" not in cell["diagnosis"]["remedy"]


def test_a_memory_error_outside_an_import_does_not_blame_torch(tmp_path, monkeypatch):
    """Issue 42: a MemoryError from a huge input, in a command that imports no torch, read "could not load
    torch/transformers". Planted both ways: raised by packcheck's own work, and raised while a module is imported."""
    from pytest_packcheck.errors import load_failure_message

    def work():
        raise MemoryError

    try:
        work()
    except MemoryError as exc:
        said = load_failure_message(exc)
    assert said.startswith("packcheck ran out of memory in test_hostile_inputs.py:") and "torch" not in said
    (tmp_path / "huge_module_for_the_test.py").write_text("raise MemoryError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        __import__("huge_module_for_the_test")
    except MemoryError as exc:
        said = load_failure_message(exc)
    assert said.startswith("packcheck could not load torch/transformers (MemoryError")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_journal_that_is_not_a_file_is_not_read_by_resume(tmp_path, kind):
    """Trial of issue 42: a journal symlinked to /dev/zero was read by --packcheck-resume until the OOM killer; a FIFO
    hung it. It is named in one warning, not read, and replaced by a journal of the run's own."""
    import os

    reports = tmp_path / "reports"
    reports.mkdir()
    journal = reports / "packcheck-journal.jsonl"
    if kind == "dev-zero":
        journal.symlink_to("/dev/zero")
    else:
        os.mkfifo(journal)
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama",
                           "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0", "-q", "--resume"],
                          cwd=tmp_path, capture_output=True, text=True, check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "is not a regular file (a device or a pipe)" in out, out[-1500:]
    assert journal.is_file() and not journal.is_symlink() and len(journal.read_text().splitlines()) == 1


def test_a_fresh_run_over_an_interrupted_runs_journal_says_so_and_keeps_a_copy(tmp_path):
    """Trial of issue 42 (LOST): after a SIGKILLed audit, the same command without --resume emptied the journal of
    finished cells without a word. It now says how many it held, keeps a copy in previous/, and says how to reuse
    them; after a run that finished (its matrix newer than its journal) it says nothing."""
    import time

    base = ["audit", "--models", "arch:llama,arch:gpt2", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
            "-n", "0", "-q"]
    assert _cli(base, tmp_path).returncode == 0
    quiet = _cli(base, tmp_path)
    assert "held" not in quiet.stdout + quiet.stderr
    reports = tmp_path / "reports"
    (reports / "packcheck-matrix.json").unlink()  # planted: a run killed before its matrix, its two cells journaled
    time.sleep(0.01)
    os_journal = reports / "packcheck-journal.jsonl"
    os_journal.write_text(os_journal.read_text())  # newer than any matrix
    proc = _cli(base, tmp_path)
    out = proc.stdout + proc.stderr
    assert "held 2 finished cell(s) of an earlier run" in out and "--packcheck-resume" in out, out[-1500:]
    kept = reports / "previous" / "packcheck-journal.jsonl"
    assert kept.exists() and len(kept.read_text().splitlines()) == 2
    assert read_results(reports / "packcheck-matrix.json")["cells"]


def test_claims_refuses_a_device_and_an_oversized_member_without_reading_them(tmp_path):
    """Trial of issue 42: `packcheck claims` on a symlink to /dev/zero ran into the OOM killer; a wheel whose source is
    one 3 GB line took 6 GB, then an OverflowError traceback. The device is one line (exit 2); a member over 16 MB
    unpacked is the peer's entry with its reason, never read."""
    from pytest_packcheck.atlas.claims import read_wheel

    (tmp_path / "zero.whl").symlink_to("/dev/zero")
    proc = _cli(["claims", str(tmp_path / "zero.whl"), "-o", str(tmp_path / "c.md")], tmp_path)
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr[-800:]
    big = tmp_path / "axolotl-2.0-py3-none-any.whl"
    with zipfile.ZipFile(big, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("axolotl-2.0.dist-info/METADATA", "Name: axolotl\nVersion: 2.0\nRequires-Dist: transformers>=4.50\n")
        z.writestr("axolotl/monkeypatch/multipack.py", "x = 1" + " " * (17 * 1024 * 1024))
    peer = read_wheel(big)
    assert peer.claims == [] and "over the 16 MB a peer's source file is read up to" in peer.reason, peer.reason


@pytest.fixture(scope="module")
def opt_results(tmp_path_factory) -> str:
    """The results file (its JSON text) of a real audit: opt's sdpa isolation cell, audited once for the module's
    tests that each plant an edit into their own copy (it was one audit subprocess per planted edit)."""
    root = tmp_path_factory.mktemp("opt_results")
    assert _cli(["audit", "--models", "arch:opt", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0",
                 "-q"], root).returncode == 0
    return (root / "reports" / "packcheck-matrix.json").read_text()


@pytest.mark.parametrize(("edit", "says"), [
    ({"causes": ["leak"]}, 'has "causes": ["leak"] (expected a list of objects with a "cause" code'),
    ({"causes": [{"cause": 123}]}, 'expected a list of objects with a "cause" code'),
    ({"causes": [{}]}, 'expected a list of objects with a "cause" code'),
    ({"causes": [{"cause": "not_a_cause"}]}, """names cause 'not_a_cause' in "causes", not a cause code of packcheck"""),
    ({"cause": "not_a_cause"}, 'has cause "not_a_cause", not a cause code of packcheck'),
    ({"check": "bogus"}, "has check 'bogus', not a check of packcheck"),
    ({"status": "pass", "cause": None, "causes": [], "metrics": {}}, "passes with no max_change (a pass rests on its check's key number)"),
], ids=["causes-strings", "cause-a-number", "cause-missing", "unknown-cause-in-list", "unknown-cause", "unknown-check",
        "pass-without-its-number"])
def test_gate_and_merge_refuse_a_results_cell_packcheck_never_writes(tmp_path, opt_results, edit, says):
    """Trial of issue 42: causes as strings crashed merge (AttributeError) while gate accepted them; an unknown cause
    code or check name was shown as if measured. One rule (results.schema.cell_problem) for both: exit 2, one line."""
    import json

    doc = json.loads(opt_results)
    doc["cells"][0].update(edit)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for args in (["gate", "--baseline", str(bad), "--candidate", str(bad)], ["merge", str(bad), "-o", str(tmp_path / "m")]):
        proc = _cli(args, tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1200:]
        assert says in proc.stderr, proc.stderr[-1200:]


def test_unclear_lines_of_the_trial_now_name_the_real_fault(tmp_path):
    """Trial of issue 42 (UNCLEAR): an audit file that is a /dev/zero symlink was "not found"; $PACKCHECK_VERSIONS was
    named "--packcheck-versions"; a results file that is a bare list was "has no schema_version"."""
    import os

    (tmp_path / "zero.json").symlink_to("/dev/zero")
    proc = _cli(["audit", "-n", "0", "-q", "--audit", str(tmp_path / "zero.json")], tmp_path)
    assert proc.returncode == 2 and "is not a regular file (a device or a pipe)" in proc.stdout + proc.stderr
    (tmp_path / "list.json").write_text("[]")
    proc = _cli(["gate", "--baseline", str(tmp_path / "list.json"), "--candidate", str(tmp_path / "list.json")], tmp_path)
    assert proc.returncode == 2 and "is a JSON list, not a packcheck results file" in proc.stderr, proc.stderr
    env = {**os.environ, "PACKCHECK_VERSIONS": "transformers==1.0.0"}
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama", "--packcheck-attn",
                           "sdpa", "--packcheck-checks", "isolation", "-q"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    if "matches no release" in out:  # the package index answered (CI reaches it); offline the lookup is skipped
        assert "(from $PACKCHECK_VERSIONS)" in out, out[-800:]


@pytest.mark.parametrize(("flag", "value"), [("--packcheck-checks", "isolation,,logits_parity"), ("--packcheck-attn", "sdpa,")])
def test_an_empty_item_in_a_list_of_names_is_refused(tmp_path, flag, value):
    """Trial of issue 42 (SILENT): `--packcheck-checks isolation,,logits_parity` was taken as two checks without a word,
    while `--packcheck-lengths 3,5,` was refused. The same rule for every list of names."""
    args = {"--packcheck-checks": "isolation", "--packcheck-attn": "sdpa"}
    args[flag] = value
    proc = _cli(["audit", "--models", "arch:llama", *[x for kv in args.items() for x in kv], "-n", "0", "-q"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"Bad list '{value}' ({flag}): item" in out and "is empty" in out, out[-800:]


def test_repeated_or_comma_joined_arguments_are_said_not_repeated(tmp_path):
    """Trial of issue 42: `packcheck checks isolation,logits_parity` answered "unknown check" with no word of how the
    command takes names; `--profile uniform` three times measured and wrote three identical rows; the same wheel
    twice was read twice."""
    proc = _cli(["checks", "isolation,logits_parity"], tmp_path)
    assert proc.returncode == 2 and "takes check names separated by spaces: packcheck checks isolation logits_parity" in proc.stderr
    bench = _cli(["bench", "--model", "arch:llama", "--profile", "uniform", "--profile", "uniform", "--steps", "1",
                  "--warmup", "1", "--batch-size", "2", "--max-length", "32", "-o", str(tmp_path / "b")], tmp_path)
    assert bench.returncode == 0, bench.stderr[-800:]
    assert "--profile given twice; each profile is measured once (uniform)" in bench.stderr
    import json

    assert len(json.loads((tmp_path / "b" / "bench.json").read_text())["results"]) == 1
    wheel = _axolotl_wheel(tmp_path / "axolotl-1.0-py3-none-any.whl", "SUPPORTED_MULTIPACK_MODEL_TYPES = ['llama']\n")
    claims = _cli(["claims", str(wheel), str(wheel), "-o", str(tmp_path / "c.md")], tmp_path)
    assert claims.returncode == 0 and "1 package(s) given twice; each is read once" in claims.stderr, claims.stderr[-800:]
    assert claims.stdout.count("axolotl 1.0") == 1


def test_the_second_trials_unclear_lines_name_the_real_source(tmp_path):
    """Second trial of issue 42 (UNCLEAR): lookup()'s path of a wrong type was a bare TypeError from pathlib; a bad
    $PACKCHECK_REPORT_DIR was named as --packcheck-report-dir, a flag never given; claims called a folder a device."""
    import os

    from pytest_packcheck.support import lookup

    with pytest.raises(PackcheckUsageError, match=r"lookup\(\): path is int 123, not a file path"):
        lookup("llama", "sdpa", "5.24.0", None, 123)
    env = {**os.environ, "PACKCHECK_REPORT_DIR": "/dev/null"}
    proc = packcheck("audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
                     "-n", "0", "-q", cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "(from $PACKCHECK_REPORT_DIR)" in out and "--packcheck-report-dir" not in out, out[-800:]
    (tmp_path / "d.whl").mkdir()
    proc = _cli(["claims", str(tmp_path / "d.whl"), "-o", str(tmp_path / "c.md")], tmp_path)
    assert proc.returncode == 2 and "is a directory" in proc.stderr, proc.stderr
