"""The repository's own upkeep, not part of the course's library: the results page and the hosted notebooks' links
and install cells, each generated from data/ or one setting and kept fresh by a test."""
