"""What the server runs (issue 39): which layers a server fuses (``fusion``, the one rule every
stage reads) and which of their scales it keeps one of (``scales``)."""
