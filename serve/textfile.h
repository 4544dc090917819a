/* textfile.h: the text files ./run reads. --ppl's stories, in the TinyStoriesV2 layout
 * (separated by lines that hold only <|endoftext|>; each stripped of surrounding white
 * space, empty ones dropped, as train/prepare.py does), and --prompts' prompts. */
#ifndef TEXTFILE_H
#define TEXTFILE_H

#include <stddef.h>

#include "kernels/errmsg.h"

typedef struct {
    char *text;     /* the file, split in place */
    char **stories; /* NUL-terminated, valid UTF-8 without NUL bytes */
    int n_stories;
} StoryFile;

/* From a file; on failure -1 and one sentence in err (missing file, no story,
 * invalid UTF-8 or a NUL byte, with the story's number). */
int storyfile_read(StoryFile *f, const char *path, char *err, size_t errlen);
/* From memory (copied); the same checks. */
int storyfile_parse(StoryFile *f, const char *data, size_t size, char *err, size_t errlen);
void storyfile_free(StoryFile *f);

/* A file of prompts, one a line (blank lines skipped, a trailing \r dropped). */
typedef struct {
    char *text;        /* the file, split in place */
    char **prompts;    /* NUL-terminated, valid UTF-8 */
    int *line_numbers; /* each prompt's line, from 1 */
    int n_prompts;
} PromptFile;

/* On failure -1 and one sentence in err naming the file (and the line): missing,
 * unreadable, a NUL byte, a line that is not valid UTF-8, or no prompt at all. */
int promptfile_read(PromptFile *f, const char *path, char *err, size_t errlen);
void promptfile_free(PromptFile *f);

/* How a message names an input file: "standard input" for "-", else msg_path's form. */
MsgPath input_name(const char *path);

/* A whole file ("-": standard input) as one NUL-terminated text (*text, malloc'd), for -f
 * and -p -: on failure -1 and one sentence in err naming the file (missing, unreadable, too
 * large, a NUL byte, not UTF-8). */
int textfile_read_text(const char *path, char **text, char *err, size_t errlen);

#endif /* TEXTFILE_H */
