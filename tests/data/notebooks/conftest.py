"""The notebooks here are pipeline fixtures (one fails on purpose), not nbval subjects: never collect them."""

collect_ignore_glob = ["*.ipynb"]
