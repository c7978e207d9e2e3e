"""patches/sglang: every diff there applies cleanly to the installed sglang 0.5.23 (dry run on a copy), and the
plugin points that let us ship zero diffs today still exist with the names and parameters k3_sglang relies on."""
import inspect
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402

PATCHES = Path(__file__).resolve().parents[3] / "patches" / "sglang"
DIFFS = sorted(PATCHES.glob("*.diff"))


@pytest.mark.skipif(not DIFFS, reason="no diffs in patches/sglang: every hook is reachable (README there)")
@pytest.mark.parametrize("diff", DIFFS, ids=lambda p: p.name)
def test_diff_applies_cleanly(diff, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    src = Path(sglang.__file__).parent
    shutil.copytree(src, tmp_path / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(diff)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{diff.name} does not apply to sglang {sglang.__version__}:\n{r.stdout}{r.stderr}"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_radix_cache_plugin_points_exist():
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    assert {"name", "factory"} <= set(_params(registry.register_radix_cache_backend))
    assert "cache_class" in _params(registry.create_unified_radix_cache)
    assert callable(registry.create_tree_cache)
    for method in ("match_prefix", "insert", "touch_prefix", "checkpoint_into_tree"):
        assert callable(getattr(UnifiedRadixCache, method, None)), f"UnifiedRadixCache.{method} is gone"
    assert "up_to" in _params(UnifiedRadixCache.checkpoint_into_tree)


def test_dp_pairing_plugin_points_exist():
    from sglang.srt.managers import prefill_delayer as pd
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from k3_sglang.dp_pairing import TARGET

    assert HookType.AROUND and callable(HookRegistry.register)
    cls_path, method = TARGET.rsplit(".", 1)
    assert cls_path.endswith("PrefillDelayer") and hasattr(pd.PrefillDelayer, method)
    want = ["self", "prev_state", "local_prefillable", "token_usage", "running_batch", "max_prefill_bs",
            "max_running_requests", "waiting_queue_len"]
    assert _params(getattr(pd.PrefillDelayer, method).__wrapped__ if hasattr(
        getattr(pd.PrefillDelayer, method), "__wrapped__") else getattr(pd.PrefillDelayer, method)) == want
    assert {"local_prefillable", "local_token_watermark_force_allow", "running_batch", "max_prefill_bs",
            "waiting_queue_len", "queue_timeout_expired"} <= set(_params(pd.PrefillDelayer._gather_info))
    assert {"next_state", "output_allow", "output_reason", "wait_forward_passes"} <= set(pd._NegotiateOutput._fields)
