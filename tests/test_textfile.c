/* The TinyStoriesV2-layout reader used by --ppl. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "serve/textfile.h"
#include "testutil.h"

static void test_splits_and_strips(void **state) {
    const char *text =
        "  First story.\nSecond line.\n<|endoftext|>\n\nStory two.\n <|endoftext|> \n\n<|endoftext|>\nLast";
    StoryFile f;
    char err[128];
    assert_int_equal(storyfile_parse(&f, text, strlen(text), err, sizeof err), 0);
    assert_int_equal(f.n_stories, 3);
    assert_string_equal(f.stories[0], "First story.\nSecond line.");
    assert_string_equal(f.stories[1], "Story two.");
    assert_string_equal(f.stories[2], "Last");
    storyfile_free(&f);
}

static void test_separator_inside_a_line_is_text(void **state) {
    const char *text = "a <|endoftext|> b\n<|endoftext|>";
    StoryFile f;
    char err[128];
    assert_int_equal(storyfile_parse(&f, text, strlen(text), err, sizeof err), 0);
    assert_int_equal(f.n_stories, 1);
    assert_string_equal(f.stories[0], "a <|endoftext|> b");
    storyfile_free(&f);
}

static void test_rejects_bad_text(void **state) {
    StoryFile f;
    char err[128];
    const char bad_utf8[] = "ok story\n<|endoftext|>\nbad \xC3\x28 byte";
    assert_int_equal(storyfile_parse(&f, bad_utf8, sizeof bad_utf8 - 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "story 2"));
    /* utf8.h's rules: a surrogate and an overlong form are not text either */
    const char surrogate[] = "a story\n<|endoftext|>\nb\n<|endoftext|>\nc \xED\xA0\x80";
    assert_int_equal(storyfile_parse(&f, surrogate, sizeof surrogate - 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "story 3"));
    assert_int_equal(storyfile_parse(&f, "\xC0\xAF", 2, err, sizeof err), -1);
    const char nul[] = "a\0b";
    assert_int_equal(storyfile_parse(&f, nul, 3, err, sizeof err), -1);
    assert_int_equal(storyfile_parse(&f, "\n<|endoftext|>\n  \n", 18, err, sizeof err), -1);
    assert_non_null(strstr(err, "no story"));
    assert_int_equal(storyfile_read(&f, "/nonexistent/file.txt", err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open"));
}

static int read_stories(const char *path, char *err, size_t errlen) {
    StoryFile f;
    const int rc = storyfile_read(&f, path, err, errlen);
    if (rc == 0) storyfile_free(&f);
    return rc;
}

static int read_prompts(const char *path, char *err, size_t errlen) {
    PromptFile f;
    const int rc = promptfile_read(&f, path, err, errlen);
    if (rc == 0) promptfile_free(&f);
    return rc;
}

/* --ppl and --prompts files: a FIFO, a device, a directory are refused at once */
static void test_special_files(void **state) {
    expect_special_files_refused(read_stories);
    expect_special_files_refused(read_prompts);
}

/* A path of 4000 bytes is shortened in the message, never the reason after it. */
static void test_long_path_keeps_the_reason(void **state) {
    char path[4001];
    long_missing_path(path);
    const char *reason = ": No such file or directory";
    StoryFile f;
    PromptFile p;
    char err[512];
    assert_int_equal(storyfile_read(&f, path, err, sizeof err), -1);
    assert_true(strlen(err) > strlen(reason));
    assert_string_equal(err + strlen(err) - strlen(reason), reason);
    assert_int_equal(promptfile_read(&p, path, err, sizeof err), -1);
    assert_string_equal(err + strlen(err) - strlen(reason), reason);
    /* a long path to a real file (through many ./) keeps its line number and the reason */
    const char *bad = temp_path("bad-prompts.txt");
    assert_int_equal(write_whole_file(bad, "fine\n\xFF\n", 7), 0);
    const char *name = strrchr(bad, '/') + 1;
    char long_bad[4100];
    snprintf(long_bad, sizeof long_bad, "%.*s", (int)(name - bad), bad);
    while (strlen(long_bad) + strlen(name) + 2 < 4000) strcat(long_bad, "./");
    strcat(long_bad, name);
    assert_int_equal(promptfile_read(&p, long_bad, err, sizeof err), -1);
    if (!strstr(err, "bad-prompts.txt:2: the prompt is not valid UTF-8 text")) fail_msg("'%s'", err);
    unlink(bad);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_splits_and_strips),          cmocka_unit_test(test_separator_inside_a_line_is_text),
        cmocka_unit_test(test_rejects_bad_text),           cmocka_unit_test(test_special_files),
        cmocka_unit_test(test_long_path_keeps_the_reason),
    };
    return cmocka_run_group_tests_name("textfile", tests, NULL, NULL);
}
