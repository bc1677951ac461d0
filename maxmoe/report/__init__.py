"""`maxmoe report`: one self-contained HTML page of one or more run directories (runs.py reads
them, figures.py draws with matplotlib, page.py assembles the page)."""
