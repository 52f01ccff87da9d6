"""The one exception type users see: its message is a single line naming the file, tensor or parameter."""


class FuselmError(Exception):
    """A problem with the user's input (path, checkpoint, prompt, parameter). The CLI prints
    `error: <message>` and exits 1 without a traceback (set FUSELM_DEBUG=1 to see one).

    The message is kept to one line whatever it quotes: line breaks inside it (from a model
    file's strings) are written as the escapes \\n and \\r."""

    def __init__(self, message: object = "", *args):
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)
