"""The one exception type users see: its message is a single line naming the file, tensor or parameter."""


class FuselmError(Exception):
    """A problem with the user's input (path, checkpoint, prompt, parameter). The CLI prints
    `error: <message>` and exits 1 without a traceback (set FUSELM_DEBUG=1 to see one)."""
