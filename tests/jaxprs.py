"""Reading traced programs in tests."""


def primitive_names(jaxpr) -> list[str]:
    """Primitive names in a jaxpr and every jaxpr nested in its equations' params."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += primitive_names(inner)
    return names
