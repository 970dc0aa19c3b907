"""Small helpers every layer may use: argument checks (``validate``), the progress bar
(``progress_bar``), and one-line command-line errors (``cli_lines``). Imports nothing of ``paged``."""
