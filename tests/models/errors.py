"""The one check of a bad checkpoint folder's error, shared by the HF and EAGLE-3 loaders' tests."""


def assert_one_clear_error(error: BaseException, path, expected) -> None:
    """``error`` names ``path`` first, says every part of ``expected`` and comes without a
    chained traceback."""
    message = str(error)
    assert message.startswith(str(path)), message
    for part in expected:
        assert part in message, message
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__), "chained traceback"
