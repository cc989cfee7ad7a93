"""The `isr` commands, one module per family; `isrctl.cli` parses the command line and calls them.

Each command is a function ``cmd_<name>(args) -> int`` that prints what the user asked for and leaves the
work to the module that owns it (checkout, session, checkin, hoard, schedule, ...)."""
