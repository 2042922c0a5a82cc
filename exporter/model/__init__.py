"""Pure model values: no sockets, threads, files or clock."""
