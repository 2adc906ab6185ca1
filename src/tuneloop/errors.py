"""Errors that are the user's to fix: the CLI prints them without a traceback and exits 2."""


class UserError(Exception):
    """A problem in the user's config, data or environment, with a message that says the fix."""
