"""The team's run history (issue 40): every run a server computed, kept in its output root so it
opens again, as it was, after a restart or for a colleague. ``run_file`` writes and reads one run,
``index`` is the SQLite index of them all, ``store`` ties the two (recording, opening, deleting,
pruning)."""
