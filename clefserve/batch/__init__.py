"""Offline batch decisions (``clef-serve batch``): a file of records through the in-process engine into a
durable, resumable OUTPUT. ``sources`` reads the input, ``records`` checks each record as the HTTP route
does, ``lookahead`` groups records sharing a state, ``feeder`` keeps the engine full, ``output`` appends
and recovers OUTPUT, ``job`` is the loop, ``progress`` the bar and summary, ``command`` the command line."""
