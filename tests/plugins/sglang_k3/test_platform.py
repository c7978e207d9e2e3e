"""The CPU platform and the entry point, through SGLang's own discovery (`sglang.srt.platforms`, `load_plugins`)."""
import importlib.metadata

import torch

import k3_sglang
from k3_sglang import platform as k3_platform


def test_sglang_resolves_our_platform_and_get_device_answers_cpu():
    from sglang.srt.platforms import current_platform
    from sglang.srt.utils.common import get_device

    assert isinstance(current_platform, k3_platform.K3CpuPlatform)
    assert current_platform.is_out_of_tree() and not current_platform.is_cuda()
    assert str(get_device()) == "cpu"  # the mixin's torch.device("cpu"), as SGLang's CPU platform returns
    assert current_platform.get_device() == torch.device("cpu")
    assert current_platform.get_torch_distributed_backend_str() == "gloo"
    free, total = current_platform.get_available_memory()
    assert 0 < free <= total


def test_platform_stays_out_of_the_way_on_an_accelerator_host(monkeypatch):
    """Installed on a GPU host, the distribution must not claim the platform (SGLang would refuse two)."""
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert k3_platform.activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", k3_platform.PLATFORM_NAME)  # named explicitly: it applies
    assert k3_platform.activate() == k3_platform.PLATFORM_QUALNAME


def test_entry_points_are_installed_under_sglangs_group_names():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP

    general = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GENERAL_PLUGINS_GROUP)}
    platforms = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=PLATFORM_PLUGINS_GROUP)}
    assert general.get("k3") == "k3_sglang:register"
    assert platforms.get(k3_platform.PLATFORM_NAME) == "k3_sglang.platform:activate"


def test_register_calls_each_present_feature_once_in_order(monkeypatch):
    calls = []
    present = {"kda_backend", "weights"}

    class Feature:
        def __init__(self, name):
            self.register = lambda: calls.append(name)

    monkeypatch.setattr(k3_sglang, "_registered", [])
    monkeypatch.setattr(k3_sglang.importlib.util, "find_spec",
                        lambda name: object() if name.rsplit(".", 1)[-1] in present else None)
    monkeypatch.setattr(k3_sglang.importlib, "import_module", lambda name: Feature(name.rsplit(".", 1)[-1]))
    assert k3_sglang.register() == ["kda_backend", "weights"]
    assert k3_sglang.register() == ["kda_backend", "weights"]  # idempotent: SGLang loads plugins per process
    assert calls == ["kda_backend", "weights"]
