"""The SQLite tree of the source and what prepare chose: its rows, schema, read side and building; the identity of
what it recorded."""
