"""Running a rank task: reading source boxes, writing the target file, exports, read-ahead."""
