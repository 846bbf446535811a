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

    kernels.triton_implementation("decode_attention")  # imports kernels.decode_attention (the module)
    assert callable(kernels.decode_attention)
    assert kernels.decode_attention.__name__ == "decode_attention"
