"""kvref.impl.vllm — the one package that imports vLLM, and the one place that binds to its API.

Everything that drives vLLM's own classes lives here: the ``KVCacheManager`` adapter
(:mod:`.kv_cache_manager`), the ``Scheduler``/``AsyncScheduler`` adapter (:mod:`.scheduler`),
startup planning (:mod:`.planning`), the offload engines and block pool driver (:mod:`.offload`,
:mod:`.block_pool`), what is installed (:mod:`.installed`) and which of vLLM's symbols kvref binds
to (:mod:`.api`). A vLLM whose API moved is therefore met in one place, and every other layer can be
imported without vLLM: each module imports vLLM lazily, inside the functions that need it — except
:mod:`.record`, whose recording schedulers subclass vLLM's ``Scheduler``/``AsyncScheduler`` and so
import vLLM when the module loads; it is imported only lazily (by :mod:`kvref.record`, which a vLLM
engine loads through ``scheduler_cls``, and by the demo's recording run).

kvref models vLLM 0.33.0. Any other installed version — a fork, a nightly, an editable checkout
reporting ``0.33.1.dev12+gdeadbee`` — is driven all the same: where it behaves differently the
conformance checks report a finding, and where its API moved :func:`.api.check_api` names the
symbol.
"""

from .installed import REFERENCE_VLLM_VERSION, VllmInstall, describe_installed_vllm, vllm_available
from .kv_cache_manager import VllmKVCacheManager, make_vllm_manager
from .specs import to_vllm_kv_cache_config, to_vllm_spec

__all__ = [
    "REFERENCE_VLLM_VERSION", "VllmInstall", "VllmKVCacheManager", "describe_installed_vllm", "make_vllm_manager",
    "to_vllm_kv_cache_config", "to_vllm_spec", "vllm_available",
]
