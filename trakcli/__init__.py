"""trakcli: gradient-based data attribution (TRAK) as a command-line tool and library."""

__version__ = "0.1.0"
