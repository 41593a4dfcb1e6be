"""Runtime of the overlap-loop collective guard that patches/ call into."""
