"""The operator's side of ``runtime-agent``: client commands, how they print, the live view."""
