"""What a run writes: output paths checked up front and files written atomically, mp4 and tensor files, the report
and its timeline chart."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "files": "OUTPUTS apply_user_mode plan_outputs user_file_mode write_atomic write_json",
    "plotting": "Chart",
    "report": "block_kind block_line render_timeline summarize write_report write_timeline",
    "video": "Mp4Stream probe_video read_video_frames save_tensor_file to_uint8 write_mp4",
})
