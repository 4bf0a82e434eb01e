"""Reading traced programs in tests."""

from collections.abc import Iterator


def equations(jaxpr) -> Iterator:
    """Every equation of a jaxpr and of the jaxprs nested in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def primitive_names(jaxpr) -> list[str]:
    """Primitive names in a jaxpr and every jaxpr nested in its equations' params."""
    return [eqn.primitive.name for eqn in equations(jaxpr)]
