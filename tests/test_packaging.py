"""Packaging-level checks."""


def test_podkit_kernels_package_does_not_fool_transformers():
    # Our top-level package is named `kernels`, like Hugging Face's optional hub-kernels package,
    # which transformers probes to decide whether to fetch kernels from the hub.
    from transformers.utils import import_utils

    probe = getattr(import_utils, "is_kernels_available", None)
    if probe is not None:
        assert probe() is False


def test_public_ops_are_exported():
    import kernels

    for name in kernels.__all__:
        assert hasattr(kernels, name), name


def test_public_ops_stay_callable_after_triton_submodule_import():
    import kernels
    import kernels.triton_decode_attention  # noqa: F401  (tests and benchmarks import launchers directly)
    import kernels.triton_prefill_attention  # noqa: F401

    kernels.triton_implementation("decode_attention")
    for name in kernels._TRITON_IMPLEMENTATIONS:
        assert callable(getattr(kernels, name)), name
    assert kernels.decode_attention.__name__ == "decode_attention"
