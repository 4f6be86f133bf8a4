import kvref
import kvref.spec


def test_spec_imports_from_installed_package():
    assert kvref.spec.SlidingWindowSpec.__module__ == "kvref.spec.kv_cache_interface"
    assert kvref.spec.cdiv(7, 2) == 4
