"""The one exception type for a user's mistake: the CLI prints its message on one line, exit 2."""


class UserError(Exception):
    """A bad config, file, path or argument. The message names the key or file and what would
    be valid; the CLI prints it as one line and exits with status 2, never with a traceback."""
