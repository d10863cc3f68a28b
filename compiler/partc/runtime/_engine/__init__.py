"""The runtime's reading engine: which byte runs of a checkpoint a rank's selections cover, the
jobs and threads that read them into fresh arrays or views of the mapped files, and the
column gathers. Private to `partc.runtime`; its modules form a DAG from `selection`."""
