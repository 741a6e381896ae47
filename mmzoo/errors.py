"""The error mmzoo raises for bad input: one clear line, shown to CLI users without a traceback."""


class MmzooError(ValueError):
    """Bad user input (a path, a field, a shape): the message names the field and the numbers."""


def find_mmzoo_error(e: BaseException | None) -> MmzooError | None:
    """The :class:`MmzooError` behind an exception (itself, or its cause, as OmegaConf wraps a
    resolver's errors and Hydra a builder's), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, MmzooError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
