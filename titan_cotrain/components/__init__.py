"""The torchtitan adapter (``titan``): the one place the project talks to torchtitan."""
