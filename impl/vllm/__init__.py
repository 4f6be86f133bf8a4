"""kvref.impl.vllm — the one package that imports vLLM, and the one place that binds to its API.

Everything that drives vLLM's own classes lives here: the ``KVCacheManager`` adapter
(:mod:`.kv_cache_manager`), the ``Scheduler``/``AsyncScheduler`` adapter (:mod:`.scheduler`),
startup planning (:mod:`.planning`), the offload engines and block pool driver (:mod:`.offload`,
:mod:`.block_pool`), what is installed (:mod:`.installed`) and which of vLLM's symbols kvref binds
to (:mod:`.api`). A vLLM whose API moved is therefore met in one place, and every other layer can be
imported without vLLM: each module imports vLLM lazily, inside the functions that need it, through
the one loader (:func:`.loader.load_vllm`) where it can. Classes that subclass vLLM's (the recording
schedulers of :mod:`.record`, the out-of-tree tier of :mod:`.tiering_tiers`) are built when first
asked for, by the module's ``__getattr__`` (how vLLM resolves ``--scheduler-cls`` and a tier's
``module_path``). ``tests/impl/vllm/test_lazy_imports.py`` imports every module with vLLM made
unimportable. vLLM's own objects are built from kvref's specs by one converter (:mod:`.specs`),
and vLLM's ``Request`` and ``SamplingParams`` from kvref's request data by one door
(:mod:`.vrequest`, #26; ``tests/impl/vllm/test_vrequest.py`` fails if another module builds one).

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
