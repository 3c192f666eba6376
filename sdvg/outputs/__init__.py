"""What a run writes: output paths checked up front and files written atomically, mp4 and tensor files, the report
and its timeline chart."""
