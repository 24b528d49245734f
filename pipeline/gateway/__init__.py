"""The admission gateway: a Faust app between the request topics and the dispatch topics."""
