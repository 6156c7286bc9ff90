"""Test-only helpers: what the library's tests share (fixtures' data), apart from bench/ and the library."""
