"""`--radix-cache-backend k3` through SGLang's own path: the distribution's entry point (`load_plugins()`, restricted
to ours with SGLANG_PLUGINS) registers the backend; SGLang's CLI parser takes the flag into ServerArgs; with those
args published, `create_tree_cache` (what the scheduler calls) builds K3RadixCache over the kit's pools; a name
nobody registered is refused by SGLang with the registered names in the message."""
import argparse
from unittest import mock

import pytest

pytest.importorskip("sglang")

from _sglang_helpers import load_k3_plugins  # noqa: E402
from sglang.srt.mem_cache import registry  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CONFIGS  # noqa: E402

from k3_sglang import radix_replay  # noqa: E402
from k3_sglang.radix_cache import BACKEND, K3RadixCache  # noqa: E402


@pytest.fixture(scope="module")
def plugins():
    mod = load_k3_plugins()
    assert "radix_cache" in mod.register() and "dp_pairing" in mod.register()
    return mod


def test_entry_point_registers_backend(plugins):
    assert BACKEND in registry.registered_radix_cache_backends()
    assert registry.get_radix_cache_factory(BACKEND).__module__ == "k3_sglang.radix_cache"


def test_cli_flag_reaches_server_args(plugins):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "dummy", "--radix-cache-backend", BACKEND])
    assert ns.radix_cache_backend == BACKEND


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[5], CONFIGS[7]], ids=lambda c: c.label)
def test_create_tree_cache_builds_ours(plugins, cfg):
    cache, _, _ = radix_replay.build_cache(cfg, "k3")
    assert type(cache) is K3RadixCache
    assert cache.supports_mamba() == cfg.has_mamba


def test_unregistered_name_refused_by_sglang(plugins):
    def via_unknown(params):
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
        from sglang.srt.runtime_context import get_server_args
        ctx = TreeCacheBuildContext(server_args=get_server_args(), params=params, is_hybrid_swa=False,
                                    is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
                                    tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        return create_tree_cache(ctx)

    import functools
    with mock.patch.object(fixtures, "UnifiedRadixCache", via_unknown), \
            mock.patch.object(fixtures, "ServerArgs", functools.partial(ServerArgs, radix_cache_backend="k4")):
        with pytest.raises(ValueError, match=r"k4.*not registered.*'k3'"):
            fixtures.build_fixture(CONFIGS[0])
