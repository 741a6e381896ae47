"""The error mmzoo raises for bad input: one clear line, shown to CLI users without a traceback."""


class MmzooError(ValueError):
    """Bad user input (a path, a field, a shape): the message names the field and the numbers."""
