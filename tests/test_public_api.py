"""The public surface: one __init__, a sorted and complete __all__."""

import inspect

import remat


def test_all_is_sorted_and_every_name_exists() -> None:
    assert list(remat.__all__) == sorted(remat.__all__)
    for name in remat.__all__:
        assert hasattr(remat, name), name


def test_all_lists_every_public_function_and_class_exported() -> None:
    exported = {
        name
        for name, value in vars(remat).items()
        if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
    }
    assert exported <= set(remat.__all__), sorted(exported - set(remat.__all__))


def test_subpackages_are_reachable() -> None:
    assert callable(remat.plan.get_solver)
    assert "resnet18" in remat.models.CATALOGUE
    assert remat.__version__
