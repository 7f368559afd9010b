"""Run by tests/test_versions.py with the python of a transformers 4.44 .. 4.55.0 version environment: the varlen
reference on a tiny llama (isolation, logits_parity, backend), then the same with the planted fault of a flash path
that ignores position_ids (what transformers' did before 4.44). Prints one JSON object."""

import json
import sys

import tomllib
import transformers

from pytest_packcheck import backends as BK
from pytest_packcheck import checks as C
from pytest_packcheck.config.audits import PACKAGE_AUDIT_DIR
from pytest_packcheck.model.build import build_model
from pytest_packcheck.model.resolve import resolve_model
from pytest_packcheck.model.specs import parse_model_spec

tol = tomllib.loads((PACKAGE_AUDIT_DIR / "tolerances.toml").read_text())["float32"]
out = {"transformers": transformers.__version__, "mode": BK.reference_mode()}


def run(tag):
    resolved = resolve_model(parse_model_spec("arch:llama", "test"), "test")
    model = build_model(resolved, BK.REFERENCE_BACKEND, "float32")
    bench = C.Workbench(model=model, config=model.config, backend=BK.REFERENCE_BACKEND, dtype="float32", tol=tol)
    out[tag] = {name: {"status": r.status, "cause": r.cause, "metrics": r.metrics} for name, r in
                (("isolation", C.check_isolation(bench)), ("logits_parity", C.check_logits_parity(bench)),
                 ("backend", C.check_backend(bench)))}
    out[tag]["config_attn"] = model.config._attn_implementation


import transformers.modeling_flash_attention_utils as mfu

FLASH_NAMES = ("flash_attn_func", "flash_attn_varlen_func", "pad_input", "unpad_input", "index_first_axis",
               "_flash_supports_window_size", "_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn", "_is_fa3",
               "_flash_supports_window", "is_flash_attn_2_available", "is_flash_attn_greater_or_equal")
before = {n: vars(mfu).get(n, "<absent>") for n in FLASH_NAMES}
run("reference")
# every module global packcheck set for the forwards is back as it was (absent without flash-attn)
out["restored"] = before == {n: vars(mfu).get(n, "<absent>") for n in FLASH_NAMES}
out["flash_attn_varlen_func_after"] = str(vars(mfu).get("flash_attn_varlen_func", "<absent>"))
# the planted fault: the model's flash path drops position_ids, as transformers' did before 4.44
# planted where the model's flash path calls it: llama's FlashAttention2 class (before 4.48), else the
# AttentionInterface's flash_attention_forward (both bound the name at import)
owner = next(m for m in (sys.modules["transformers.models.llama.modeling_llama"],
                         sys.modules.get("transformers.integrations.flash_attention"))
             if m is not None and "_flash_attention_forward" in vars(m))
original = owner._flash_attention_forward
owner._flash_attention_forward = lambda *a, position_ids=None, **k: original(*a, **k)
run("planted")
json.dump(out, sys.stdout, default=str)
