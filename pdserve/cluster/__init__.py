"""pdserve on a Ray cluster: instances and the router as Ray actors (`pdserve up --ray`)."""
