"""The `onebit` command line: parses, calls the library, prints. No engine logic here."""
